#!/usr/bin/env bash
# The export verifier on 2 GPUs: TP2, PP2, PP2xVPP2 in fp32 and bf16, on a tiny and a medium model.
# Writes one JSON line per run to ${OUT:-.}/verify_export.jsonl.
set -u
out=${OUT:-.}/verify_export.jsonl
python3 recipes/make_tiny_model.py /tmp/vx/tiny --layers 8 > /dev/null
python3 recipes/make_tiny_model.py /tmp/vx/medium --layers 8 --hidden-size 1024 --heads 16 \
  --kv-heads 8 --vocab-size 32000 > /dev/null
status=0
for model in tiny medium; do
  for layout in "--tp 2" "--pp 2" "--pp 2 --vpp 2"; do
    for dtype in float32 bfloat16; do
      torchrun --nproc-per-node 2 recipes/verify_export.py --hf-path /tmp/vx/$model \
        $layout --dtype $dtype > /tmp/vx/out.txt 2> /tmp/vx/err.txt
      rc=$?
      line=$(tail -1 /tmp/vx/out.txt)
      [ -n "$line" ] || { line='{"error": "no output"}'; tail -20 /tmp/vx/err.txt; }
      echo "{\"model\": \"$model\", \"layout\": \"$layout\", \"rc\": $rc, \"report\": $line}" | tee -a "$out"
      [ "$rc" = 0 ] || status=1
    done
  done
done
exit $status
