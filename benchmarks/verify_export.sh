#!/usr/bin/env bash
# The export verifier; needs 2 GPUs. A tiny and a medium Qwen3-MoE (8 / 32 experts) at EP2, PP2
# and PP2xVPP2 in fp32 (bf16 rounding can flip a token's top-k expert choice, which is not a
# conversion error; MoE with TP2 needs sequence parallelism, which needs transformer-engine); then
# a tiny and a medium Llama at TP2, PP2 and PP2xVPP2 in fp32 and bf16.
# Writes one JSON line per run to $OUT/verify_export.jsonl; exits 1 if any run failed.
set -u
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
out=$OUT/verify_export.jsonl
rm -rf /tmp/vx  # make_tiny_model refuses a non-empty directory (an earlier run's)
python3 recipes/make_tiny_model.py /tmp/vx/tiny --layers 8 > /dev/null
python3 recipes/make_tiny_model.py /tmp/vx/medium --layers 8 --hidden-size 1024 --heads 16 \
  --kv-heads 8 --vocab-size 32000 > /dev/null
python3 recipes/make_tiny_model.py /tmp/vx/tiny_moe --arch qwen3_moe --layers 8 > /dev/null
python3 recipes/make_tiny_model.py /tmp/vx/medium_moe --arch qwen3_moe --layers 8 \
  --hidden-size 1024 --heads 16 --kv-heads 8 --vocab-size 32000 --experts 32 \
  --experts-per-token 4 > /dev/null
status=0
run() {  # run MODEL LAYOUT DTYPE
  torchrun --nproc-per-node 2 recipes/verify_export.py --hf-path /tmp/vx/$1 $2 --dtype $3 \
    > /tmp/vx/out.txt 2> /tmp/vx/err.txt
  rc=$?
  line=$(tail -1 /tmp/vx/out.txt)
  [ -n "$line" ] || { line='{"error": "no output"}'; tail -20 /tmp/vx/err.txt; }
  echo "{\"model\": \"$1\", \"layout\": \"$2\", \"rc\": $rc, \"report\": $line}" | tee -a "$out"
  [ "$rc" = 0 ] || status=1
}
for model in tiny_moe medium_moe; do
  for layout in "--ep 2" "--pp 2" "--pp 2 --vpp 2"; do
    run $model "$layout" float32
  done
done
for model in tiny medium; do
  for layout in "--tp 2" "--pp 2" "--pp 2 --vpp 2"; do
    for dtype in float32 bfloat16; do
      run $model "$layout" $dtype
    done
  done
done
exit $status
