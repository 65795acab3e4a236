#!/usr/bin/env bash
# Needs 2 GPUs, nothing else running on them: run directories and resume on CUDA with the tiny
# Llama, colocated, 2 ranks at PP2 x VPP2 (one GPU and engine each), once as configured and once
# with the trainer offloaded to the host while the engines generate
# (inference.offload_trainer=true: every checkpoint save brings it back to the GPU first):
#   1. 4 steps with a checkpoint every 2; the same directory again without --resume must be
#      refused (exit 1, "already holds a run");
#   2. --resume to 6 steps: metrics.jsonl holds steps 1..6 once, trainer_state.json names
#      checkpoints/step_000006 (relative);
#   3. the policy's checkpoint resume test on 2 GPUs (tests/gpu/test_policy_gpu.py -k resume;
#      checkpoints are saved through compat.in_process_write_results).
# Results under $OUT/resume: rc.txt, errors.txt, check.txt (expected per variant: "<variant>:
# steps [1, 2, 3, 4, 5, 6] checkpoint checkpoints/step_000006 refused True").
set -u
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/resume; mkdir -p "$D"
# Checkpoints and run directories are made afresh (an earlier run's would be refused).
rm -rf /tmp/resume-tiny runs/gpu_resume_*
python3 recipes/make_tiny_model.py /tmp/resume-tiny --layers 8 > /dev/null || exit 1
grpo() {  # grpo VARIANT NAME [args]
  local variant=$1 name=$2; shift 2
  local extra=(); [ "$variant" = offload ] && extra=(inference.offload_trainer=true)
  step "${variant}_$name" 150 torchrun --standalone --nproc-per-node 2 recipes/grpo.py \
    --config configs/grpo_tiny_cpu_colocated.yaml model.hf_path=/tmp/resume-tiny \
    run.output_dir=runs/gpu_resume_$variant run.checkpoint_every=2 "${extra[@]}" "$@"
}
for variant in plain offload; do
  grpo $variant first run.steps=4
  grpo $variant reuse run.steps=4
  grpo $variant resumed run.steps=6 --resume
  python3 - "$variant" "$D/check.txt" << 'PY'
import json, pathlib, sys
variant = sys.argv[1]
run = pathlib.Path(f"runs/gpu_resume_{variant}")
steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
state = json.loads((run / "trainer_state.json").read_text())
refused = "already holds a run" in pathlib.Path(f"/tmp/{variant}_reuse.err").read_text()
line = f"{variant}: steps {steps} checkpoint {state['checkpoint']} refused {refused}"
print(line)
with open(sys.argv[2], "a") as out:
    out.write(line + "\n")
PY
done
step policy_resume 240 python3 -m pytest tests/gpu/test_policy_gpu.py -q -p no:cacheprovider \
  -k resume
grep -E "passed|failed|skipped" /tmp/policy_resume.out | tail -n 3 >> "$D/check.txt"
cat "$D/rc.txt" "$D/check.txt"; echo "total ${SECONDS}s"
