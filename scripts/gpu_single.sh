#!/usr/bin/env bash
# On one GPU (nvidia-h200), after `source scripts/device_env.sh` (carry .whl): GRPO colocated
# from configs/grpo_gpu_colocated.yaml as committed, then the colocated refit bench (synthetic
# dense 8B, then the Megatron Llama-3-8B preset through the export).
# Results under ${OUT:-.}/single: grpo_colocated_metrics.jsonl, summaries.txt, bench.jsonl, rc.txt.
set -u
D=${OUT:-.}/single; mkdir -p "$D"; export PYTHONUNBUFFERED=1
run() {  # run NAME LIMIT COMMAND...: output to /tmp/NAME.{out,err}, exit code to rc.txt
  local name=$1 limit=$2 start=$SECONDS; shift 2
  timeout "$limit" "$@" > "/tmp/$name.out" 2> "/tmp/$name.err"
  echo "rc=$? $name $((SECONDS - start))s (limit ${limit}s)" >> "$D/rc.txt"
  { echo "== $name"; tail -n 1 "/tmp/$name.out" | cut -c1-2000; grep -E "Error|error:|Timeout" \
      "/tmp/$name.err" | grep -v "FP8GlobalStateManager\|import_utils" | tail -n 5; } \
    >> "$D/summaries.txt"
}
python3 recipes/make_tiny_model.py /tmp/llama-0.5b --layers 24 --hidden-size 1536 --heads 12 \
  --kv-heads 4 > /dev/null || exit 1
run grpo_colocated 330 torchrun --nproc-per-node 1 --master-port 29821 recipes/grpo.py \
  --config configs/grpo_gpu_colocated.yaml
cp runs/grpo_gpu_colocated/metrics.jsonl "$D/grpo_colocated_metrics.jsonl" 2> /dev/null
bench() {  # bench NAME LIMIT [overrides]
  local name=$1 limit=$2; shift 2
  run "$name" "$limit" torchrun --nproc-per-node 1 --master-port 29822 recipes/refit_bench.py \
    --config configs/refit_bench.yaml refit.mode=colocated bench.output="$D/bench.jsonl" "$@"
}
bench bench_dense 70 bench.source=dense_8b
bench bench_megatron 110 bench.source=megatron \
  'bench.modes=[raw_link,engine,export_alone,transport_alone]'
cat "$D/rc.txt"; echo "total ${SECONDS}s"
