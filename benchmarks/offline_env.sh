# For a GPU host without network access whose Python lacks the pinned packages: put their wheels
# in .whl/ at the repository root (built elsewhere with `pip wheel` / `pip download` from
# requirements*.txt and constraints.txt), then, from the repository root:
#     source benchmarks/offline_env.sh
# installs them into a private folder (MCORE_REFIT_SITE, default /tmp/mcore_refit_site), puts it and
# the repository on PYTHONPATH and prints the versions found and the number of GPUs.
site=${MCORE_REFIT_SITE:-/tmp/mcore_refit_site}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
export PYTHONUNBUFFERED=1
python3 -c 'import torch, transformers, megatron.core
print("torch", torch.__version__, "transformers", transformers.__version__,
      "mcore", megatron.core.__version__, "gpus", torch.cuda.device_count())'
