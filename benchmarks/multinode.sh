#!/usr/bin/env bash
# Needs 2 GPUs of one host: GRPO as a two-node job on one host. Two torchrun agents (--nnodes 2
# --node-rank 0|1) meet at one rendezvous endpoint, each seeing one GPU (CUDA_VISIBLE_DEVICES),
# so every rank has LOCAL_RANK 0 and picks its GPU on its own "node":
#   1. colocated: the tiny Llama at PP2 x VPP2, one trainer rank and its engine per node;
#   2. non-colocated: the ~0.5B config at PP1, trainer rank on node 0, inference rank on node 1;
#      refits go over NCCL between the agents.
# Both with run.verify_refit (the engines' weights checked against the trainer's every step).
# Results under $OUT/multinode: rc.txt, errors.txt, summaries.jsonl (node 0's last lines).
set -u
STEPS=${STEPS:-20} BUDGET_S=${BUDGET_S:-570}
# A dry run on CPU: MODEL=/tmp/mn-model TINY=/tmp/mn-tiny MODEL_ARGS="--layers 2" STEPS=1
MODEL=${MODEL:-/tmp/llama-0.5b} TINY=${TINY:-/tmp/tiny-llama}
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/multinode; mkdir -p "$D"

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])'
}

two_nodes() {  # two_nodes NAME LIMIT SCRIPT ARGS...: node 1 in the background, node 0 as the step
  local name=$1 limit=$2 port; shift 2
  port=$(free_port)
  local agent=(torchrun --nnodes 2 --nproc-per-node 1 --master-addr 127.0.0.1 --master-port "$port")
  CUDA_VISIBLE_DEVICES=1 timeout -s INT -k 15 "$limit" "${agent[@]}" --node-rank 1 "$@" \
    > "/tmp/${name}_node1.out" 2> "/tmp/${name}_node1.err" &
  local node1=$!
  CUDA_VISIBLE_DEVICES=0 step "$name" "$limit" "${agent[@]}" --node-rank 0 "$@"
  wait "$node1"
  local rc=$?
  echo "rc=$rc ${name}_node1" >> "$D/rc.txt"
  [ "$rc" = 0 ] \
    || { echo "== ${name}_node1"; tail -n 25 "/tmp/${name}_node1.err"; } >> "$D/errors.txt"
  summarize "$name"
}

python3 recipes/make_tiny_model.py "$TINY" --layers 8 > /dev/null || exit 1
python3 recipes/make_tiny_model.py "$MODEL" \
  ${MODEL_ARGS:---layers 24 --hidden-size 1536 --heads 12 --kv-heads 4} > /dev/null || exit 1

two_nodes multinode_colocated 200 recipes/grpo.py --config configs/grpo_tiny_cpu_colocated.yaml \
  model.hf_path="$TINY" run.steps="$STEPS" run.verify_refit=true \
  run.output_dir=runs/multinode_colocated
two_nodes multinode_non_colocated 300 recipes/grpo.py \
  --config configs/grpo_gpu_non_colocated_pp2_vpp2.yaml model.hf_path="$MODEL" parallel.pipeline=1 \
  parallel.virtual_pipeline=null inference.num_ranks=1 run.steps="$STEPS" run.verify_refit=true \
  run.output_dir=runs/multinode_non_colocated
for run in colocated non_colocated; do
  cp "runs/multinode_$run/metrics.png" "$D/multinode_${run}.png" 2> /dev/null
done
cat "$D/rc.txt" "$D/errors.txt"; cut -c1-400 "$D/summaries.jsonl"; echo "total ${SECONDS}s"
