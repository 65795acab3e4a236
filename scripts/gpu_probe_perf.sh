#!/usr/bin/env bash
# Probe (nvidia-h200-x2), after `source scripts/device_env.sh`: where the trainer-only export
# pass spends its time at TP1 / TP2 / PP2 (scripts/gpu_probe_export.py), and the colocated dense
# refit of this tree against the tree in OLD_TREE (a `git archive` of an earlier commit), same
# config, same call. Results under ${OUT:-.}/probe.
set -u
D=${OUT:-.}/probe; mkdir -p "$D"; export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/steps.sh"
port=29830
probe() {  # probe NAME NPROC [overrides...]
  local name=$1 nproc=$2; shift 2; port=$((port + 1))
  step "$name" 80 python3 -m torch.distributed.run --nproc-per-node "$nproc" \
    --master-addr 127.0.0.1 --master-port "$port" scripts/gpu_probe_export.py \
    bench.trainer_only=true "$@"
  grep '^{' "/tmp/$name.out" | sed "s/^/{\"run\": \"$name\", \"probe\": /; s/$/}/" >> "$D/export.jsonl"
}
probe export_tp1 1
probe export_tp2 2 bench.num_trainer_ranks=2 megatron.parallel.tensor=2
probe export_pp2 2 bench.num_trainer_ranks=2 megatron.parallel.pipeline=2
COLOCATED='bench.modes=[raw_link,engine,transport_alone]'
for tree in new old; do
  dir=.; [ $tree = old ] && dir=${OLD_TREE:-_old}
  port=$((port + 1))
  (cd "$dir" && export PYTHONPATH="$(pwd):$PYTHONPATH" && step "colocated_$tree" 90 python3 -m torch.distributed.run --nproc-per-node 1 \
    --master-addr 127.0.0.1 --master-port "$port" recipes/refit_bench.py \
    --config configs/refit_bench.yaml bench.output="$D/colocated_$tree.jsonl" \
    refit.mode=colocated bench.source=dense_8b "$COLOCATED")
  tail -n 2 "/tmp/colocated_$tree.out" > "$D/colocated_${tree}_tail.txt"
done
cat "$D/rc.txt"; echo "total ${SECONDS}s"
