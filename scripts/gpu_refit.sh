#!/usr/bin/env bash
# Refit engine on 2 GPUs: GPU tests, then the benchmark for every source and placement.
# Writes gpu_tests.txt, bench.jsonl, rc.txt (one line per run) under ${OUT:-.}/refit.
set -u
D=${OUT:-.}/refit; mkdir -p "$D"; export PYTHONUNBUFFERED=1; port=29730
timeout 100 python3 -m pytest tests/gpu/test_refit_gpu.py -q -p no:cacheprovider > "$D/gpu_tests.txt" 2>&1
echo "rc=$? gpu_tests" >> "$D/rc.txt"
bench() {
  local limit=$1 nproc=$2; shift 2; port=$((port + 1))
  timeout "$limit" python3 -m torch.distributed.run --nproc-per-node "$nproc" \
    --master-addr 127.0.0.1 --master-port "$port" recipes/refit_bench.py \
    --config configs/refit_bench.yaml bench.output="$D/bench.jsonl" "$@" \
    >> "$D/bench_out.txt" 2>> "$D/bench_err.txt"
  echo "rc=$? nproc=$nproc $*" >> "$D/rc.txt"
}
bench 50 2 bench.source=dense_8b
bench 80 2 bench.source=moe_30b_a3b
bench 50 1 refit.mode=colocated bench.source=dense_8b
bench 100 1 refit.mode=colocated bench.source=moe_30b_a3b
megatron_modes='bench.modes=[raw_link,engine,export_alone,transport_alone]'
bench 110 2 bench.source=megatron "$megatron_modes"
bench 90 1 refit.mode=colocated bench.source=megatron "$megatron_modes"
cat "$D/rc.txt"; tail -3 "$D/gpu_tests.txt"
