#!/usr/bin/env bash
# Needs 2 GPUs and vLLM 0.25.0 importable (from VLLM_SITE, default /tmp/vsite, added to
# PYTHONPATH): GRPO with vLLM as the inference engine (inference.engine=vllm) on the ~0.5B
# Llama-shaped model of benchmarks/grpo.sh, every refit verified inside vLLM
# (run.verify_refit=true):
#   vllm_colocated      configs/grpo_gpu_colocated.yaml, one GPU (vLLM in the engine process);
#   vllm_non_colocated  configs/grpo_gpu_non_colocated_pp2_vpp2.yaml, 3 processes on 2 GPUs
#                       (vLLM on the inference rank, beside trainer rank 1 on GPU 1);
# side by side on 3 GPUs (0 | 1, 2), one after the other on 2; STEPS steps each (default 60). Results under $OUT/grpo_vllm: <run>_metrics.jsonl,
# summaries.jsonl (the recipes' last lines: reward_first/last, logprob_mult_err), rc.txt,
# errors.txt.
set -u
STEPS=${STEPS:-60} BUDGET_S=${BUDGET_S:-400}
MODEL=/tmp/llama-0.5b
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/grpo_vllm; mkdir -p "$D"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}${VLLM_SITE:-/tmp/vsite}"

grpo() {  # grpo NAME LIMIT NPROC CONFIG [overrides...]
  local name=$1 limit=$2 nproc=$3 config=$4; shift 4
  rm -rf "runs/$name"
  step "$name" "$limit" torchrun --standalone --nproc-per-node "$nproc" recipes/grpo.py \
    --config "$config" inference.engine=vllm run.verify_refit=true run.steps="$STEPS" \
    run.output_dir="runs/$name" "$@"
  summarize "$name"
  cp "runs/$name/metrics.jsonl" "$D/${name}_metrics.jsonl" 2> /dev/null
}

[ -d "$MODEL" ] || python3 recipes/make_tiny_model.py "$MODEL" \
  ${MODEL_ARGS:---layers 24 --hidden-size 1536 --heads 12 --kv-heads 4} > /dev/null || exit 1
if [ "$(nvidia-smi -L | wc -l)" -ge 3 ]; then pair=1,2; else pair=0,1; fi
CUDA_VISIBLE_DEVICES=0 grpo vllm_colocated 240 1 configs/grpo_gpu_colocated.yaml &
[ "$pair" = 1,2 ] || wait
CUDA_VISIBLE_DEVICES=$pair grpo vllm_non_colocated 240 3 \
  configs/grpo_gpu_non_colocated_pp2_vpp2.yaml
wait
cat "$D/rc.txt"; cut -c1-600 "$D/summaries.jsonl"; echo "total ${SECONDS}s"
