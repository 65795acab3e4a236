# Source on a GPU machine whose image lacks our pinned packages: installs the wheels carried in
# .whl/ (made by ../shared/device/wheels.sh) into a private folder and puts it and the repo on
# PYTHONPATH. Usage: source scripts/device_env.sh
site=${DEVICE_SITE:-/tmp/mcore_refit_site}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 -c 'import torch, transformers, megatron.core; print("torch", torch.__version__, "transformers", transformers.__version__, "mcore", megatron.core.__version__, "gpus", torch.cuda.device_count())'
