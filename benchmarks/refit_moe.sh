#!/usr/bin/env bash
# The Megatron Qwen3-30B-A3B preset (random bf16 weights, 128 experts, top-8) refitted on 2 GPUs
# with NVLink at expert parallelism 2 (each trainer
# rank holds 64 experts of every layer and sends them itself):
#   non_colocated_ep2  2 trainer ranks (GPU0, GPU1) -> 1 inference rank on GPU1, NCCL broadcast;
#   colocated_ep2      2 ranks, each trains and refits its own engine on its GPU over CUDA IPC;
#   colocated_shared   1 rank, EP1, the engine reading the trainer's own tensors (shared_weights
#                      needs one trainer rank per engine), with RUNS=colocated_shared on one GPU.
# Every mode verified bit for bit; the summary line compares the refit with transport_alone (the
# same bytes from tensors already in memory). Full depth (48 layers) where the GPUs hold it
# (>= 120 GiB each: H200s), else 24 layers; each JSON line's "model" says which.
# LAYERS=N forces the depth; RUNS="non_colocated_ep2" runs those rows only.
# Results under $OUT/refit_moe: bench.jsonl, summaries.jsonl, rc.txt, errors.txt.
set -u
BUDGET_S=${BUDGET_S:-585}
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/refit_moe; mkdir -p "$D"
port=29770
RUNS=${RUNS:-non_colocated_ep2 colocated_ep2}
CONFIG=${CONFIG:-configs/refit_bench.yaml}  # CONFIG=configs/refit_bench_cpu.yaml: a dry run on CPU
PRESET=${PRESET:-qwen3_30b_a3b}             # PRESET=tiny_qwen3_moe: a dry run on CPU
LAYERS=${LAYERS:-$(python3 -c 'import torch
big = torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory >= 120 * 2**30
print(48 if big else 24)')}
echo "preset $PRESET at $LAYERS layers" >> "$D/rc.txt"

bench() {  # bench NAME LIMIT NPROC [overrides...]: the preset at $LAYERS layers, bf16
  local name=$1 limit=$2 nproc=$3; shift 3
  refit_bench "$name" "$limit" "$nproc" bench.source=megatron megatron.preset="$PRESET" \
    megatron.num_layers="$LAYERS" megatron.dtype=bfloat16 "$@"
}

bench non_colocated_ep2 280 3 bench.num_trainer_ranks=2 megatron.parallel.expert=2 \
  'bench.modes=[raw_link,engine,transport_alone]'
bench colocated_ep2 280 2 refit.mode=colocated bench.num_trainer_ranks=2 \
  megatron.parallel.expert=2 'bench.modes=[raw_link,engine,transport_alone]'
bench colocated_shared 500 1 refit.mode=colocated \
  'bench.modes=[raw_link,shared_weights,transport_alone]'
python3 - "$D/summaries.jsonl" >> "$D/rc.txt" << 'PY'
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except OSError:
    sys.exit()
for row in rows:
    s = row["summary"]
    modes = s.get("modes", {})
    refit = {m: v.get("refit_s_median") for m, v in modes.items() if isinstance(v, dict)}
    print(f"{row['run']}: model {s.get('model')}, all_verified {s.get('all_verified')}, "
          f"refit_s_median {refit}, targets {s.get('targets')}")
PY
cat "$D/rc.txt"; echo "total ${SECONDS}s"
