#!/usr/bin/env bash
# The refit into vLLM GPU workers; needs 2 GPUs with NVLink and vLLM 0.25.0 importable (from
# VLLM_SITE, default /tmp/vsite, added to PYTHONPATH; the GPU wheel pins the image's torch 2.11).
# The Megatron Llama-3-8B preset (random bf16 weights, 16.06 GB) refitted into vLLM, which starts
# from the preset's HF config with dummy weights (no checkpoint written: every refit brings the
# real weights through vLLM's loader); each mode's last refit verified inside vLLM (the trainer's
# digests of what arrived, and every vLLM parameter against vLLM's plain loader):
#   vllm_non_colocated  trainer rank on GPU0 -> vLLM on GPU1, NCCL broadcast;
#   vllm_colocated      vLLM in an engine process on the trainer's GPU, CUDA IPC (slots, and
#                       shared_weights: vLLM's worker reads the trainer's own tensors);
#                       (with verify and transport_alone it needs 97 GiB on that GPU: an H200;
#                       on an 80 GB H100 the memory check refuses it at start-up);
# each with the refit (engine), the same from tensors captured in memory (transport_alone) and
# vLLM's own load of the same tensors (vllm_load_floor; target engine <= 1.2 x the floor); then
#   tensors_non_colocated, tensors_colocated: the same refits into the transport's tensor engine.
# One call of < 9 min. RUNS="vllm_non_colocated tensors_non_colocated" runs those rows only.
# Results under $OUT/vllm: bench.jsonl (every line), summaries.jsonl, rc.txt, errors.txt.
set -u
BUDGET_S=${BUDGET_S:-530}
source "$(dirname "$0")/common.sh"  # OUT absolute, cwd the repository root, step/summarize
D=$OUT/vllm; mkdir -p "$D"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}${VLLM_SITE:-/tmp/vsite}"
# The bench does not sample: without this vLLM's warm-up JIT-builds flashinfer's sampling kernels
# (minutes on a fresh machine).
export VLLM_USE_FLASHINFER_SAMPLER=0
port=29790
python3 -c 'import vllm; print("vllm", vllm.__version__)' > "$D/vllm_version.txt" 2>&1 \
  || { echo "vLLM does not import:"; tail -n 5 "$D/vllm_version.txt"; exit 1; }

bench() {  # bench NAME LIMIT NPROC [overrides...]: the Megatron Llama-3-8B preset
  local name=$1 limit=$2 nproc=$3; shift 3
  refit_bench "$name" "$limit" "$nproc" bench.source=megatron "$@"
}

VLLM='bench.modes=[engine,transport_alone,vllm_load_floor]'
TENSORS='bench.modes=[raw_link,engine,transport_alone]'
bench vllm_non_colocated 200 2 bench.engine=vllm "$VLLM"
bench vllm_colocated 200 1 refit.mode=colocated bench.engine=vllm \
  'bench.modes=[engine,shared_weights,transport_alone,vllm_load_floor]'
bench tensors_non_colocated 60 2 "$TENSORS"
bench tensors_colocated 60 1 refit.mode=colocated "$TENSORS"
cat "$D/rc.txt"; echo "total ${SECONDS}s"
