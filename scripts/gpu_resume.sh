#!/usr/bin/env bash
# On a 2-GPU node (nvidia-h200-x2), after `source scripts/device_env.sh` (carry .whl), nothing
# else running on the GPUs: run directories and resume on CUDA with the tiny Llama, colocated,
# 2 ranks at PP2 x VPP2 (one GPU and engine each):
#   1. 4 steps with a checkpoint every 2; the same directory again without --resume must be
#      refused (exit 1, "already holds a run");
#   2. --resume to 6 steps: metrics.jsonl holds steps 1..6 once, trainer_state.json names
#      checkpoints/step_000006 (relative);
#   3. the policy's checkpoint resume test on 2 GPUs (tests/gpu/test_policy_gpu.py -k resume;
#      checkpoints are saved through compat.in_process_write_results).
# Results under ${OUT:-.}/resume: rc.txt, errors.txt, check.txt (expected: "steps [1, 2, 3, 4,
# 5, 6] checkpoint checkpoints/step_000006 refused True").
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
D=${OUT:-.}/resume; mkdir -p "$D"; export PYTHONUNBUFFERED=1
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/steps.sh"
# A warm machine keeps earlier calls' files: checkpoints and run directories are made afresh.
rm -rf /tmp/resume-tiny runs/gpu_resume
python3 recipes/make_tiny_model.py /tmp/resume-tiny --layers 8 > /dev/null || exit 1
grpo() {  # grpo NAME [args]
  local name=$1; shift
  step "$name" 150 torchrun --nproc-per-node 2 --master-port 29861 recipes/grpo.py \
    --config configs/grpo_tiny_cpu_colocated.yaml model.hf_path=/tmp/resume-tiny \
    run.output_dir=runs/gpu_resume run.checkpoint_every=2 "$@"
}
grpo first run.steps=4
grpo reuse run.steps=4
grpo resumed run.steps=6 --resume
python3 - "$D/check.txt" << 'PY'
import json, pathlib, sys
run = pathlib.Path("runs/gpu_resume")
steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
state = json.loads((run / "trainer_state.json").read_text())
refused = "already holds a run" in pathlib.Path("/tmp/reuse.err").read_text()
line = f"steps {steps} checkpoint {state['checkpoint']} refused {refused}"
print(line)
pathlib.Path(sys.argv[1]).write_text(line + "\n")
PY
step policy_resume 240 python3 -m pytest tests/gpu/test_policy_gpu.py -q -p no:cacheprovider \
  -k resume
grep -E "passed|failed|skipped" /tmp/policy_resume.out | tail -n 3 >> "$D/check.txt"
cat "$D/rc.txt" "$D/check.txt"; echo "total ${SECONDS}s"
