#!/usr/bin/env bash
# On a 2-GPU node: GRPO colocated (GPU 0) alongside the MoE colocated refit bench (GPU 1), then the
# policy parity tests, then GRPO non-colocated PP2 x VPP2. Results under ${OUT:-.}.
set -u
D=${OUT:-.}; export PYTHONUNBUFFERED=1
# A warm machine keeps earlier calls' files: checkpoints and run directories are made afresh.
rm -rf /tmp/llama-0.5b runs/grpo_gpu_colocated runs/grpo_gpu_non_colocated
python3 recipes/make_tiny_model.py /tmp/llama-0.5b --layers 24 --hidden-size 1536 --heads 12 \
  --kv-heads 4 > /dev/null
run() {  # run NAME LIMIT COMMAND...: stdout/stderr to files, exit code to rc.txt
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "/tmp/$name.out" 2> "/tmp/$name.err"
  echo "rc=$? $name" >> "$D/rc.txt"
  { echo "== $name"; tail -n 3 "/tmp/$name.out"; grep -E "Error|error:" "/tmp/$name.err" \
      | grep -v "FP8GlobalStateManager\|import_utils" | tail -n 5; } >> "$D/summaries.txt"
}
CUDA_VISIBLE_DEVICES=0 run grpo_colocated 170 torchrun --standalone --nproc-per-node 1 \
  recipes/grpo.py --config configs/grpo_gpu_colocated.yaml run.steps=40 &
CUDA_VISIBLE_DEVICES=1 run bench_moe_colocated 170 torchrun --nproc-per-node 1 \
  --master-port 29802 recipes/refit_bench.py --config configs/refit_bench.yaml \
  refit.mode=colocated bench.source=moe_30b_a3b 'bench.modes=[raw_link,single_buffer,engine]' \
  bench.output="$D/bench_moe_colocated.jsonl" &
wait
run policy_gpu 170 python3 -m pytest tests/gpu/test_policy_gpu.py -s -q -p no:cacheprovider
cp /tmp/policy_gpu.out "$D/policy_gpu.txt"
run grpo_non_colocated 170 torchrun --standalone --nproc-per-node 3 recipes/grpo.py \
  --config configs/grpo_gpu_non_colocated_pp2_vpp2.yaml run.steps=40
cp runs/grpo_gpu_colocated/metrics.jsonl "$D/grpo_colocated_metrics.jsonl" 2> /dev/null
cp runs/grpo_gpu_non_colocated/metrics.jsonl "$D/grpo_non_colocated_metrics.jsonl" 2> /dev/null
cat "$D/rc.txt" "$D/summaries.txt"
