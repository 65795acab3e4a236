#!/usr/bin/env bash
# On a 2-GPU node: GRPO colocated on GPU 0 alongside the policy PP2 x VPP2 vs PP1 parity tests.
set -u
D=${OUT:-.}; export PYTHONUNBUFFERED=1
python3 recipes/make_tiny_model.py /tmp/llama-0.5b --layers 24 --hidden-size 1536 --heads 12 \
  --kv-heads 4 > /dev/null
(CUDA_VISIBLE_DEVICES=0 timeout 240 torchrun --nproc-per-node 1 --master-port 29811 \
  recipes/grpo.py --config configs/grpo_gpu_colocated.yaml run.steps=40 \
  > /tmp/grpo_colocated.out 2> /tmp/grpo_colocated.err; echo "rc=$? grpo_colocated" >> "$D/rc.txt") &
timeout 240 python3 -m pytest tests/gpu/test_policy_gpu.py -s -q -p no:cacheprovider \
  -k "matches_pp1 or hugging_face" > "$D/policy_gpu.txt" 2>&1
echo "rc=$? policy_gpu" >> "$D/rc.txt"
wait
tail -n 2 /tmp/grpo_colocated.out > "$D/grpo_colocated_summary.txt"
grep -E "Error" /tmp/grpo_colocated.err | grep -v "FP8GlobalStateManager\|import_utils" \
  | tail -n 5 >> "$D/grpo_colocated_summary.txt"
cp runs/grpo_gpu_colocated/metrics.jsonl "$D/grpo_colocated_metrics.jsonl" 2> /dev/null
cat "$D/rc.txt" "$D/grpo_colocated_summary.txt"; grep -E "FIGURES|passed|failed" "$D/policy_gpu.txt"
