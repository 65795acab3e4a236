#!/usr/bin/env bash
# Needs 2 GPUs: GRPO with a ~1.3B-total Qwen3-MoE-shaped policy at expert parallelism 2,
# colocated (each rank trains on its GPU and refits its own engine there),
# configs/grpo_gpu_colocated_moe.yaml. STEPS (default 100).
# Results under $OUT/grpo_moe: moe_metrics.jsonl, summaries.jsonl (the recipe's last line:
# reward_first/reward_last, logprob_mult_err_max), rc.txt, errors.txt, and the mean reward over
# the first and last 10 steps in rc.txt.
set -u
STEPS=${STEPS:-100} BUDGET_S=${BUDGET_S:-580}
MODEL=/tmp/qwen3-moe-1b
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/grpo_moe; mkdir -p "$D"

# The checkpoint and run directory are made afresh (an earlier run's would be refused).
rm -rf "$MODEL" runs/grpo_moe
# MODEL_ARGS: a smaller model for a dry run on CPU.
python3 recipes/make_tiny_model.py "$MODEL" --arch qwen3_moe \
  ${MODEL_ARGS:---layers 24 --hidden-size 1024 --heads 16 --kv-heads 4 --experts 32 \
  --experts-per-token 4} \
  > /dev/null || exit 1
step moe 540 torchrun --standalone --nproc-per-node 2 recipes/grpo.py \
  --config configs/grpo_gpu_colocated_moe.yaml run.steps="$STEPS" run.output_dir=runs/grpo_moe
summarize moe
cp runs/grpo_moe/metrics.jsonl "$D/moe_metrics.jsonl" 2> /dev/null
python3 - "$D/moe_metrics.jsonl" >> "$D/rc.txt" << 'PY'
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except OSError:
    sys.exit()
first, last = rows[:10], rows[-10:]
mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
print(f"steps {len(rows)}: mean reward first 10 {mean(first, 'reward_mean'):.3f} -> last 10 "
      f"{mean(last, 'reward_mean'):.3f}; logprob_mult_err max "
      f"{max(r['logprob_mult_err'] for r in rows):.7f}")
PY
cat "$D/rc.txt"; cut -c1-400 "$D/summaries.jsonl"; echo "total ${SECONDS}s"
