#!/usr/bin/env bash
# Needs 2 GPUs: GRPO on the ~0.5B Llama-shaped model.
#   1. Colocated, one GPU each, two learning rates side by side (GPU 0: LR_A, GPU 1: LR_B).
#   2. Non-colocated PP2 x VPP2 (3 processes on the 2 GPUs) at the learning rate whose colocated
#      run ended with the higher mean reward over its last 20 steps.
#   3. With what is left of the budget: 10 more non-colocated steps with --resume.
# Results under $OUT/grpo: <run>_metrics.jsonl, summaries.jsonl (the recipes' last lines),
# rc.txt (exit code and seconds per step), errors.txt.
set -u
LR_A=${LR_A:-0.00003} LR_B=${LR_B:-0.0001} STEPS=${STEPS:-150} WARMUP=${WARMUP:-10}
BUDGET_S=${BUDGET_S:-570}
MODEL=/tmp/llama-0.5b
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/grpo; mkdir -p "$D"

grpo() {  # grpo NAME LIMIT NPROC CONFIG LR [extra args]; env RUN_DIR (default NAME)
  local name=$1 limit=$2 nproc=$3 config=$4 lr=$5; shift 5
  local dir=${RUN_DIR:-$name}
  # A run directory belongs to one run (an earlier sweep's is removed); --resume continues it.
  case " $* " in *" --resume "*) ;; *) rm -rf "runs/$dir" ;; esac
  step "$name" "$limit" torchrun --standalone --nproc-per-node "$nproc" \
    recipes/grpo.py --config "$config" run.steps="$STEPS" run.output_dir="runs/$dir" \
    policy.optimizer.lr="$lr" policy.optimizer.lr_warmup_steps="$WARMUP" "$@"
  summarize "$name"
  cp "runs/$dir/metrics.jsonl" "$D/${dir}_metrics.jsonl" 2> /dev/null
}

tail_reward() {  # mean reward over the last 20 logged steps of a run (-1 when absent)
  python3 - "$1" << 'EOF'
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
    print(sum(r["reward_mean"] for r in rows[-20:]) / len(rows[-20:]))
except (OSError, ValueError, ZeroDivisionError):
    print(-1)
EOF
}

# MODEL_ARGS: a smaller model for a dry run on CPU.
rm -rf "$MODEL"
python3 recipes/make_tiny_model.py "$MODEL" \
  ${MODEL_ARGS:---layers 24 --hidden-size 1536 --heads 12 --kv-heads 4} > /dev/null || exit 1

C=configs/grpo_gpu_colocated.yaml
CUDA_VISIBLE_DEVICES=0 grpo colocated_lr_a 260 1 "$C" "$LR_A" &
CUDA_VISIBLE_DEVICES=1 grpo colocated_lr_b 260 1 "$C" "$LR_B" &
wait
A=$(tail_reward "$D/colocated_lr_a_metrics.jsonl")
B=$(tail_reward "$D/colocated_lr_b_metrics.jsonl")
LR=$(python3 -c "print('$LR_A' if $A >= $B else '$LR_B')")
echo "last-20 mean reward: lr $LR_A -> $A, lr $LR_B -> $B; non-colocated at lr $LR" >> "$D/rc.txt"

grpo non_colocated 240 3 configs/grpo_gpu_non_colocated_pp2_vpp2.yaml "$LR"
STEPS=$((STEPS + 10)) RUN_DIR=non_colocated grpo non_colocated_resumed 90 3 \
  configs/grpo_gpu_non_colocated_pp2_vpp2.yaml "$LR" --resume
cat "$D/rc.txt"; cut -c1-400 "$D/summaries.jsonl"; echo "total ${SECONDS}s"
