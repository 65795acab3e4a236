#!/usr/bin/env bash
# Needs 2 GPUs, nothing else running on them (colocated trainers own their device):
#   1. GRPO colocated with 2 trainer ranks (tiny Llama, PP2 x VPP2), one engine per GPU;
#   2. the GRPO failure tests on NCCL (an engine killed before a refit, a failed connect, a
#      corrupted tensor, an aborted broadcast refit): every rank must raise the same error;
#   3. the refit GPU tests (NCCL broadcast GPU0 -> GPU1, colocated CUDA IPC);
#   4. GRPO colocated, 1 rank, the ~0.5B config for 20 steps.
# Results under $OUT/colocated: rc.txt, errors.txt, summaries.jsonl, fault_tests.txt.
set -u
BUDGET_S=${BUDGET_S:-580}
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/colocated; mkdir -p "$D"

# Checkpoints and run directories are made afresh (an earlier run's would be refused).
rm -rf /tmp/tiny-llama /tmp/llama-0.5b runs/colocated_2_ranks runs/colocated_1_rank
python3 recipes/make_tiny_model.py /tmp/tiny-llama --layers 8 > /dev/null || exit 1
python3 recipes/make_tiny_model.py /tmp/llama-0.5b --layers 24 --hidden-size 1536 --heads 12 \
  --kv-heads 4 > /dev/null || exit 1

step grpo_colocated_2_ranks 150 torchrun --standalone --nproc-per-node 2 recipes/grpo.py \
  --config configs/grpo_tiny_cpu_colocated.yaml model.hf_path=/tmp/tiny-llama run.steps=30 \
  run.output_dir=runs/colocated_2_ranks
summarize grpo_colocated_2_ranks

step fault_tests 240 python3 -m pytest tests/dist/test_grpo.py -q -p no:cacheprovider \
  -k "dying or connect or corrupted or broadcast_refit_fails or two_colocated"
grep -E "passed|failed|skipped|Error" /tmp/fault_tests.out | tail -n 20 > "$D/fault_tests.txt"

step refit_gpu_tests 120 python3 -m pytest tests/gpu/test_refit_gpu.py -q -p no:cacheprovider
grep -E "passed|failed|skipped" /tmp/refit_gpu_tests.out | tail -n 3 >> "$D/fault_tests.txt"

step grpo_colocated_1_rank 150 torchrun --standalone --nproc-per-node 1 recipes/grpo.py \
  --config configs/grpo_gpu_colocated.yaml run.steps=20 run.output_dir=runs/colocated_1_rank
summarize grpo_colocated_1_rank
cat "$D/rc.txt" "$D/summaries.jsonl" "$D/fault_tests.txt"; echo "total ${SECONDS}s"
