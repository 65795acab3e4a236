#!/usr/bin/env bash
# Refit at every Megatron layout; needs 2 GPUs with NVLink (one for RUNS=colocated_tp1): the
# refit GPU tests, then the Megatron Llama-3-8B preset (random bf16 weights) refitted at
# TP1/PP1 (2 ranks) and at PP2, PP2xVPP2 and TP2 (3 ranks: 2 trainer ranks, 1 inference rank on
# GPU1 beside trainer rank 1), the export paths with the trainer ranks alone, and colocated TP1.
# RUNS="alone_tp1 alone_tp2" runs those rows only (the GPU tests run when RUNS is unset).
# Results under $OUT/layouts: bench.jsonl (every line), summaries.jsonl, rc.txt, errors.txt.
set -u
BUDGET_S=${BUDGET_S:-585}
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/layouts; mkdir -p "$D"
port=29750

bench() {  # bench NAME LIMIT NPROC [overrides...]: the Megatron Llama-3-8B preset
  local name=$1 limit=$2 nproc=$3; shift 3
  refit_bench "$name" "$limit" "$nproc" bench.source=megatron "$@"
}

CONFIG=${CONFIG:-configs/refit_bench.yaml}  # CONFIG=configs/refit_bench_cpu.yaml: a dry run on CPU
REFIT='bench.modes=[raw_link,engine,transport_alone,export_alone,bridge_export]'
EXPORT='bench.modes=[export_alone,bridge_export_alone]'
PP2='megatron.parallel.pipeline=2'
VPP2='megatron.parallel.virtual_pipeline=2'
TP2='megatron.parallel.tensor=2'

if [ -z "${RUNS:-}" ]; then
  step gpu_tests 100 python3 -m pytest tests/gpu/test_refit_gpu.py -q -p no:cacheprovider
  tail -n 3 /tmp/gpu_tests.out >> "$D/rc.txt"
fi
bench tp1 75 2 "$REFIT"
bench pp2 80 3 "$REFIT" bench.num_trainer_ranks=2 "$PP2"
bench pp2_vpp2 80 3 "$REFIT" bench.num_trainer_ranks=2 "$PP2" "$VPP2"
bench tp2 80 3 "$REFIT" bench.num_trainer_ranks=2 "$TP2"
bench alone_tp1 45 1 "$EXPORT" bench.trainer_only=true
bench alone_pp2 50 2 "$EXPORT" bench.trainer_only=true bench.num_trainer_ranks=2 "$PP2"
bench alone_pp2_vpp2 50 2 "$EXPORT" bench.trainer_only=true bench.num_trainer_ranks=2 "$PP2" "$VPP2"
bench alone_tp2 50 2 "$EXPORT" bench.trainer_only=true bench.num_trainer_ranks=2 "$TP2"
bench colocated_tp1 80 1 refit.mode=colocated \
  'bench.modes=[raw_link,engine,shared_weights,transport_alone,export_alone,bridge_export]'
cat "$D/rc.txt"; echo "total ${SECONDS}s"
