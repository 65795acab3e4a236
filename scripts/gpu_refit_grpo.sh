#!/usr/bin/env bash
# One device call on nvidia-h200-x2, after `source scripts/device_env.sh`: the GPU GRPO configs
# (~0.5B Llama-shaped model, STEPS steps) with the refit figures of scripts/gpu_refit.sh beside
# them. Colocated GRPO on GPU0 runs while the colocated refit benchmark has GPU1; then
# non-colocated GRPO (trainer PP2 x VPP2 on both GPUs + 1 inference rank on GPU1), then the
# non-colocated refit benchmark. Results under ${OUT:-.}/grpo and ${OUT:-.}/refit.
set -u
D=${OUT:-.}/grpo; mkdir -p "$D"; export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS=${STEPS:-150} LR=${LR:-0.00003} BUDGET_S=${BUDGET_S:-585}
MODEL=/tmp/llama-0.5b
source "$(dirname "$0")/steps.sh"

grpo() {  # grpo NAME LIMIT NPROC CONFIG [extra overrides]
  local name=$1 limit=$2 nproc=$3 config=$4; shift 4
  rm -rf "runs/$name"  # a run directory belongs to one run (a warm machine keeps old ones)
  step "$name" "$limit" torchrun --standalone --nproc-per-node "$nproc" \
    recipes/grpo.py --config "$config" run.steps="$STEPS" run.output_dir="runs/$name" \
    policy.optimizer.lr="$LR" "$@"
  summarize "$name"
  cp "runs/$name/metrics.jsonl" "$D/${name}_metrics.jsonl" 2> /dev/null
}

rm -rf "$MODEL"
python3 recipes/make_tiny_model.py "$MODEL" \
  ${MODEL_ARGS:---layers 24 --hidden-size 1536 --heads 12 --kv-heads 4} > /dev/null || exit 1
CUDA_VISIBLE_DEVICES=0 grpo colocated 280 1 configs/grpo_gpu_colocated.yaml &
CUDA_VISIBLE_DEVICES=1 PLACEMENT=colocated BUDGET_S=270 bash scripts/gpu_refit.sh > /dev/null &
wait
grpo non_colocated 200 3 configs/grpo_gpu_non_colocated_pp2_vpp2.yaml
# ${EXTRA}: rows of scripts/gpu_refit_layouts.sh (RUNS) before the non-colocated refit rows.
[ -z "${EXTRA:-}" ] || RUNS="$EXTRA" BUDGET_S=$((BUDGET_S - SECONDS)) \
  bash scripts/gpu_refit_layouts.sh > /dev/null
PLACEMENT=non_colocated BUDGET_S=$((BUDGET_S - SECONDS)) bash scripts/gpu_refit.sh > /dev/null
cat "$D/rc.txt" "${OUT:-.}/refit/rc.txt"; cut -c1-600 "$D/summaries.jsonl"; echo "total ${SECONDS}s"
