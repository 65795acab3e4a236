#!/usr/bin/env bash
# Needs 4 GPUs of one host with NVLink (nvidia-h200-x4): the refit table of issue 25 in one call.
#   non-colocated, every refit mode with each fan-out (refit.transport.fanout
#   broadcast|relay|direct):
#     one_to_one      Llama-3-8B preset (bf16, random weights) TP1, 1 trainer -> 1 engine
#     pp2_vpp2_2to2   PP2 x VPP2, 2 trainer ranks -> 2 engines
#     tp2_2to2        TP2, 2 -> 2
#     one_to_three    TP1, 1 -> 3
#     moe_ep2_2to2    Qwen3-30B-A3B preset at $MOE_LAYERS layers (default 24), EP2, 2 -> 2
#   colocated, an engine process beside each of 4 trainer ranks, against the floor measured in
#   the same launch (each GPU's ingress by an all-gather, its own share by a device copy):
#     colocated_tp2_pp2_vpp2, colocated_pp4 (8B), colocated_moe_ep4 (MoE, $MOE_LAYERS layers)
#   shared_weights  one GPU: the engine reads the trainer's own tensors (the 8B preset, TP1),
#                   against the device copy; runs on GPU 2 beside one_to_one (GPUs 0-1).
#   refused_moe_48  the 48-layer MoE at EP2 on GPUs 0-1 with the engine beside trainer rank 1:
#                   refused by the memory check within seconds (refused.txt).
# Each launch: 1 warm-up, 2 timed refits and 1 verified refit per mode. Runs stop within BUDGET_S
# (520 s), the MoE rows and the colocated ones last; RUNS="name ..." runs those only (e.g. the
# rows a first call left "not run"). Results under $OUT/x4_refit: <run>.jsonl per run,
# summaries.jsonl, rc.txt, errors.txt, refused.txt, table.md (printed at the end: one row per run
# and fan-out).
# A dry run on CPU (step limits × LIMIT_SCALE): CONFIG=configs/refit_bench_cpu.yaml \
#   DENSE=tiny_llama MOE=tiny_qwen3_moe MOE_LAYERS=4 LIMIT_SCALE=5 BUDGET_S=3000 \
#   benchmarks/four_gpus_refit.sh
set -u
BUDGET_S=${BUDGET_S:-520}  # + ~30 s for benchmarks/offline_env.sh: one 600 s call
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/x4_refit; mkdir -p "$D"
CONFIG=${CONFIG:-configs/refit_bench.yaml}
DENSE=${DENSE:-llama3_8b}; MOE=${MOE:-qwen3_30b_a3b}; MOE_LAYERS=${MOE_LAYERS:-24}
REPS='bench.num_warmup=1 bench.num_refits=2 bench.verify=true'
MODES='bench.modes=[raw_link,engine,transport_alone]'
FANOUTS='bench.fanouts=[broadcast,relay,direct]'
COLOCATED_MODES='bench.modes=[raw_link,engine]'  # after $MODES on the command line: it wins

run() {  # run NAME LIMIT NPROC PORT [overrides...]: recipes/refit_bench.py into $D/NAME.jsonl
  local name=$1 limit=$(($2 * ${LIMIT_SCALE:-1})) nproc=$3 port=$4; shift 4
  [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" $name "* ]] || return 0
  rm -f "$D/$name.jsonl"
  # shellcheck disable=SC2086
  step "$name" "$limit" python3 -m torch.distributed.run --nproc-per-node "$nproc" \
    --master-addr 127.0.0.1 --master-port "$port" recipes/refit_bench.py --config "$CONFIG" \
    $REPS bench.output="$D/$name.jsonl" "$@"
  summarize "$name"
}
dense() { local name=$1 limit=$2 nproc=$3 port=$4; shift 4
  run "$name" "$limit" "$nproc" "$port" bench.source=megatron megatron.preset="$DENSE" \
    megatron.dtype=bfloat16 "$MODES" "$@"; }
moe() { local name=$1 limit=$2 nproc=$3 port=$4; shift 4
  run "$name" "$limit" "$nproc" "$port" bench.source=megatron megatron.preset="$MOE" \
    megatron.num_layers="$MOE_LAYERS" megatron.dtype=bfloat16 "$MODES" "$@"; }

# The memory check (item 5): the 48-layer MoE preset at EP2 with the engine beside trainer rank 1
# on 2 GPUs must be refused before anything starts (its message lands in refused.txt).
if [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" refused_moe_48 "* ]]; then
  ( export CUDA_VISIBLE_DEVICES=0,1; step refused_moe_48 60 python3 -m torch.distributed.run \
      --nproc-per-node 3 --master-addr 127.0.0.1 --master-port 29860 recipes/refit_bench.py \
      --config "$CONFIG" bench.source=megatron bench.num_trainer_ranks=2 \
      megatron.preset="$MOE" megatron.parallel.expert=2 \
      'bench.modes=[raw_link,engine,transport_alone]'
    grep -h -m 1 "InsufficientGpuMemory" /tmp/refused_moe_48.err > "$D/refused.txt" ) &
fi
# One GPU beside two: shared_weights on GPU 2 while one_to_one runs on GPUs 0-1.
( export CUDA_VISIBLE_DEVICES=2; run shared_weights 90 1 29861 bench.source=megatron \
    megatron.preset="$DENSE" megatron.dtype=bfloat16 refit.mode=colocated \
    'bench.modes=[raw_link,shared_weights]' ) &
( export CUDA_VISIBLE_DEVICES=0,1; dense one_to_one 90 2 29862 )
wait
dense pp2_vpp2_2to2 120 4 29863 "$FANOUTS" bench.num_trainer_ranks=2 \
  megatron.parallel.pipeline=2 megatron.parallel.virtual_pipeline=2
dense tp2_2to2 120 4 29864 "$FANOUTS" bench.num_trainer_ranks=2 megatron.parallel.tensor=2
dense one_to_three 120 4 29865 "$FANOUTS"
moe moe_ep2_2to2 170 4 29868 "$FANOUTS" bench.num_trainer_ranks=2 megatron.parallel.expert=2
# Colocated rows: the refit against the floor (no transport_alone: its copy only costs time).
dense colocated_tp2_pp2_vpp2 80 4 29866 refit.mode=colocated bench.num_trainer_ranks=4 \
  megatron.parallel.tensor=2 megatron.parallel.pipeline=2 megatron.parallel.virtual_pipeline=2 \
  "$COLOCATED_MODES"
dense colocated_pp4 80 4 29867 refit.mode=colocated bench.num_trainer_ranks=4 \
  megatron.parallel.pipeline=4 "$COLOCATED_MODES"
moe colocated_moe_ep4 130 4 29869 refit.mode=colocated bench.num_trainer_ranks=4 \
  megatron.parallel.expert=4 "$COLOCATED_MODES"

python3 benchmarks/four_gpus_table.py "$D" | tee "$D/table.md"
echo "memory check (expected: refused, naming GPU 1): $(cat "$D/refused.txt" 2> /dev/null)"
cat "$D/rc.txt"; echo "total ${SECONDS}s"
