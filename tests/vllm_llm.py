"""A tiny vLLM engine for the tests: in this process, eager, CPU kernels' head size (32)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from mcore_refit.tiny import TinyModelSpec

# vLLM in the calling process (so a refit's live process groups reach its worker), no usage
# reports, no hub lookups; vLLM's sampler helpers eager, as the GRPO recipe's CPU engines run
# them (inference/vllm/engine.py), instead of a C++ build at the engine's start.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1", "TORCH_COMPILE_DISABLE": "1"}

# Head size 32: vLLM's CPU attention refuses 16 (the default tiny model's).
LLAMA = TinyModelSpec(architecture="llama", num_layers=4, hidden_size=128, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2)
QWEN3_MOE = TinyModelSpec(architecture="qwen3_moe", num_layers=2, hidden_size=128,
                          intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                          num_experts=8, num_experts_per_token=2, moe_intermediate_size=64)


@contextlib.contextmanager
def running_llm(path: str | Path) -> Iterator:
    """``vllm.LLM`` over the checkpoint at ``path``, refitted through the mcore_refit backend.

    vLLM joins this process to a one-rank default process group and writes a dozen variables
    into its environment (``LD_PRELOAD``, ``LOCAL_WORLD_SIZE``, a shared-memory buffer's name,
    ...), which processes started later would inherit. Leaving, the engine's groups are
    destroyed and the environment (with torch.compile's switch) restored as it was, so later
    tests start clean.
    """
    import torch._dynamo

    saved = dict(os.environ)
    compile_disabled = torch._dynamo.config.disable  # read from the environment at its import
    os.environ.update(VLLM_ENV)
    torch._dynamo.config.disable = True
    try:
        from mcore_refit.bench.vllm import refittable_llm

        llm = refittable_llm(path)
        try:
            yield llm
        finally:
            del llm
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
    finally:
        torch._dynamo.config.disable = compile_disabled
        os.environ.clear()
        os.environ.update(saved)
