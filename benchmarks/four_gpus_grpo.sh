#!/usr/bin/env bash
# Needs 4 GPUs of one host: GRPO with two trainer GPUs and two engine GPUs (non-colocated, each
# inference rank on its own GPU, every refit fanned out to both), and the 4-rank parity checks.
#   policy_x4        tests/gpu/test_policy_x4_gpu.py (TP2 x PP2 x VPP2 against TP1 x PP1; FIGURES);
#   verify_moe       the export verifier, tiny Qwen3-MoE at EP2 x PP2 (fp32);
#   verify_dense     the export verifier, tiny Llama at TP2 x PP2 x VPP2 (bf16);
#   grpo_2plus2      configs/grpo_gpu_non_colocated_pp2_vpp2.yaml with inference.num_ranks=2,
#                    STEPS steps (default 150), the ~0.5B Llama of benchmarks/grpo.sh;
#   grpo_moe_2plus2  configs/grpo_gpu_colocated_moe.yaml made non-colocated with 2 inference
#                    ranks, MOE_STEPS steps (default 50), the ~1.3B-total Qwen3-MoE of
#                    benchmarks/grpo_moe.sh.
# One call of < 10 min (BUDGET_S, default 560). Results under $OUT/x4_grpo: <run>_metrics.jsonl,
# summaries.jsonl, policy_x4.txt, rc.txt, errors.txt.
set -u
STEPS=${STEPS:-150} MOE_STEPS=${MOE_STEPS:-50} BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/x4_grpo; mkdir -p "$D"
M=/tmp/x4_grpo_models; port=29880

grpo() {  # grpo NAME LIMIT CONFIG [overrides...]: 4 ranks, 2 of them inference ranks
  local name=$1 limit=$2 config=$3; shift 3
  rm -rf "runs/$name"
  step "$name" "$limit" torchrun --standalone --nproc-per-node 4 recipes/grpo.py \
    --config "$config" refit.mode=non_colocated inference.num_ranks=2 \
    run.output_dir="runs/$name" "$@"
  summarize "$name"
  cp "runs/$name/metrics.jsonl" "$D/${name}_metrics.jsonl" 2> /dev/null
}

rm -rf "$M"; mkdir -p "$M"
step make_models 90 bash -c "python3 recipes/make_tiny_model.py $M/tiny --layers 8 && \
  python3 recipes/make_tiny_model.py $M/tiny_moe --arch qwen3_moe --layers 8 && \
  python3 recipes/make_tiny_model.py $M/llama-0.5b --layers 24 --hidden-size 1536 --heads 12 \
    --kv-heads 4 && \
  python3 recipes/make_tiny_model.py $M/qwen3-moe-1b --arch qwen3_moe --layers 24 \
    --hidden-size 1024 --heads 16 --kv-heads 4 --experts 32 --experts-per-token 4" > /dev/null

grpo grpo_2plus2 200 configs/grpo_gpu_non_colocated_pp2_vpp2.yaml model.hf_path="$M/llama-0.5b" \
  run.steps="$STEPS"
grpo grpo_moe_2plus2 200 configs/grpo_gpu_colocated_moe.yaml model.hf_path="$M/qwen3-moe-1b" \
  run.steps="$MOE_STEPS" inference.offload_trainer=false
port=$((port + 1))
step verify_moe 60 torchrun --nproc-per-node 4 --master-port "$port" recipes/verify_export.py \
  --hf-path "$M/tiny_moe" --ep 2 --pp 2 --dtype float32
summarize verify_moe
port=$((port + 1))
step verify_dense 60 torchrun --nproc-per-node 4 --master-port "$port" recipes/verify_export.py \
  --hf-path "$M/tiny" --tp 2 --pp 2 --vpp 2 --dtype bfloat16
summarize verify_dense
step policy_x4 150 python3 -m pytest tests/gpu/test_policy_x4_gpu.py -s -q -p no:cacheprovider
grep -E "FIGURES|passed|failed|skipped" /tmp/policy_x4.out > "$D/policy_x4.txt" 2> /dev/null

python3 - "$D" >> "$D/rc.txt" << 'PY'
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("*_metrics.jsonl")):
    rows = [json.loads(line) for line in path.open()]
    if not rows:
        continue
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
    refits = sorted(r["refit_s"] for r in rows if "refit_s" in r)
    refit = f"; refit median {1e3 * refits[len(refits) // 2]:.1f} ms" if refits else ""
    print(f"{path.stem}: steps {len(rows)}, mean reward first 10 "
          f"{mean(rows[:10], 'reward_mean'):.3f} -> last 10 {mean(rows[-10:], 'reward_mean'):.3f}; "
          f"logprob_mult_err max {max(r['logprob_mult_err'] for r in rows):.7f}{refit}")
PY
cat "$D/rc.txt"; cut -c1-400 "$D/summaries.jsonl"; echo "total ${SECONDS}s"
