#!/usr/bin/env bash
# The refit engine on synthetic sets; needs 2 GPUs with NVLink (one for PLACEMENT=colocated):
# non-colocated (GPU0 -> GPU1) and colocated (an engine process
# on the trainer's GPU; slots, and the engine reading the trainer's tensors in place), dense 8B
# and MoE 30B-A3B shapes, each against the link (the 1 GB broadcast, or the device-to-device
# copy) measured in the same run.
# PLACEMENT=colocated or non_colocated runs those rows only (colocated needs one GPU).
# Results under $OUT/refit: bench.jsonl, summaries.jsonl, rc.txt, errors.txt.
set -u
BUDGET_S=${BUDGET_S:-585}
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/refit; mkdir -p "$D"
port=29730

if [ "${PLACEMENT:-non_colocated}" = non_colocated ]; then
  refit_bench dense 60 2 bench.source=dense_8b
  refit_bench moe 90 2 bench.source=moe_30b_a3b
fi
[ "${PLACEMENT:-colocated}" = colocated ] || { cat "$D/rc.txt"; exit 0; }
COLOCATED='raw_link,single_buffer,engine,shared_weights,export_alone,transport_alone'
refit_bench colocated_dense 80 1 refit.mode=colocated bench.source=dense_8b \
  "bench.modes=[naive,$COLOCATED]"
# MoE without naive and single_buffer (18,867 one-tensor messages, or unoverlapped packs, take
# longer than the rest of the run), and the slot-free path in a call of its own.
refit_bench colocated_moe 200 1 refit.mode=colocated bench.source=moe_30b_a3b \
  'bench.modes=[raw_link,engine,export_alone,transport_alone]'
refit_bench colocated_moe_shared 100 1 refit.mode=colocated bench.source=moe_30b_a3b \
  'bench.modes=[raw_link,shared_weights]'
cat "$D/rc.txt"; echo "total ${SECONDS}s"
