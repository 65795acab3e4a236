#!/usr/bin/env bash
# On one GPU (nvidia-h200), after `source scripts/device_env.sh` (carry .whl): GRPO colocated
# from configs/grpo_gpu_colocated.yaml as committed, then the colocated refit bench (synthetic
# dense 8B, then the Megatron Llama-3-8B preset through the export).
# Results under ${OUT:-.}/single: grpo_colocated_metrics.jsonl, summaries.jsonl, bench.jsonl,
# rc.txt, errors.txt.
set -u
D=${OUT:-.}/single; mkdir -p "$D"; export PYTHONUNBUFFERED=1
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/steps.sh"
# A warm machine keeps earlier calls' files: checkpoints and run directories are made afresh.
rm -rf /tmp/llama-0.5b runs/grpo_gpu_colocated
python3 recipes/make_tiny_model.py /tmp/llama-0.5b --layers 24 --hidden-size 1536 --heads 12 \
  --kv-heads 4 > /dev/null || exit 1
step grpo_colocated 330 torchrun --standalone --nproc-per-node 1 recipes/grpo.py \
  --config configs/grpo_gpu_colocated.yaml
summarize grpo_colocated
cp runs/grpo_gpu_colocated/metrics.jsonl "$D/grpo_colocated_metrics.jsonl" 2> /dev/null
bench() {  # bench NAME LIMIT [overrides]
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" torchrun --nproc-per-node 1 --master-port 29822 recipes/refit_bench.py \
    --config configs/refit_bench.yaml refit.mode=colocated bench.output="$D/bench.jsonl" "$@"
  summarize "$name"
}
bench bench_dense 70 bench.source=dense_8b
bench bench_megatron 110 bench.source=megatron \
  'bench.modes=[raw_link,engine,export_alone,transport_alone]'
cat "$D/rc.txt" "$D/summaries.jsonl"; echo "total ${SECONDS}s"
