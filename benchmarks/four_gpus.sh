#!/usr/bin/env bash
# Needs 4 GPUs of one host:
#   (a) the export verifier at TP2 x PP2 x VPP2, fp32 and bf16 (tiny Llama; a medium one last);
#   (b) policy parity TP2 x PP2 x VPP2 vs TP1 x PP1 (and vs TP2) over 3 optimizer steps,
#       tests/gpu/test_policy_x4_gpu.py (FIGURES lines);
#   (c) the refit bench, non-colocated: 2 trainer ranks (Llama-3-8B preset, random weights, TP2,
#       bf16) -> 2 inference ranks, every mode, verified.
# Every step runs under its own timeout, cut to what is left of a 9-minute budget. Results under
# $OUT/x4: verify_export.jsonl, policy_x4.txt, bench_x4.jsonl, rc.txt (one line per step:
# exit code, seconds), errors.txt.
set -u
BUDGET_S=540; port=29840; M=/tmp/x4_models
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/x4; mkdir -p "$D"

verify() {  # verify MODEL DTYPE LIMIT: one JSON line per run in verify_export.jsonl
  local name=verify_$1_$2
  port=$((port + 1))
  step "$name" "$3" torchrun --nproc-per-node 4 --master-port "$port" recipes/verify_export.py \
    --hf-path "$M/$1" --tp 2 --pp 2 --vpp 2 --dtype "$2"
  local report; report=$(last_json "$name")
  echo "{\"model\": \"$1\", \"dtype\": \"$2\", \"layout\": \"tp2_pp2_vpp2\", \"report\": $report}" \
    >> "$D/verify_export.jsonl"
}

rm -rf "$M/tiny" "$M/medium"  # make_tiny_model refuses a non-empty directory
step make_models 30 bash -c "python3 recipes/make_tiny_model.py $M/tiny --layers 8 && \
  python3 recipes/make_tiny_model.py $M/medium --layers 8 --hidden-size 1024 --heads 16 \
    --kv-heads 8 --vocab-size 32000"

# (a) tiny Llama, both dtypes
verify tiny float32 55
verify tiny bfloat16 55

# (b) policy parity
step policy_x4 150 python3 -m pytest tests/gpu/test_policy_x4_gpu.py -s -q -p no:cacheprovider
grep -E "FIGURES|passed|failed|skipped" /tmp/policy_x4.out > "$D/policy_x4.txt" 2> /dev/null

# (c) refit bench: Megatron at TP2 on GPUs 0-1, engines on GPUs 2-3
port=$((port + 1))
step bench_x4 180 torchrun --nproc-per-node 4 --master-port "$port" recipes/refit_bench.py \
  --config configs/refit_bench.yaml bench.source=megatron bench.num_trainer_ranks=2 \
  megatron.parallel.tensor=2 megatron.preset=llama3_8b megatron.dtype=bfloat16 \
  'bench.modes=[raw_link,naive,single_buffer,engine,export_alone,transport_alone]' \
  bench.output="$D/bench_x4.jsonl"

# (a) a medium Llama (hidden 1024, vocab 32000), with what is left of the budget
verify medium bfloat16 50
verify medium float32 50

cat "$D/rc.txt"; echo "total ${SECONDS}s"
