"""Synthetic weight sources: the shapes of real models, random values, generated on the device.

- ``dense_8b``: Llama-3-8B in Hugging Face names (291 tensors, ~16.06 GB in bf16);
- ``moe_30b_a3b``: Qwen3-30B-A3B (48 layers × 128 experts; 18,867 tensors, ~61 GB in bf16);
- ``tiny``: a few KB mixing fp32 / bf16 / fp16 / int64, a 0-dim and an empty tensor (tests,
  CPU smoke runs).

Used by the benchmark and tests; the refit engine only sees the source protocols.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from mcore_refit.refit import TensorSpec

SYNTHETIC_SETS = ("dense_8b", "moe_30b_a3b", "tiny")


def synthetic_specs(name: str, *, dtype: torch.dtype = torch.bfloat16) -> list[TensorSpec]:
    """The specs of synthetic set ``name`` (one of :data:`SYNTHETIC_SETS`)."""
    if name == "dense_8b":
        return llama_specs(num_layers=32, hidden=4096, intermediate=14336, num_heads=32,
                           num_kv_heads=8, head_dim=128, vocab=128256, dtype=dtype)
    if name == "moe_30b_a3b":
        return qwen3_moe_specs(num_layers=48, hidden=2048, num_experts=128, expert_hidden=768,
                               num_heads=32, num_kv_heads=4, head_dim=128, vocab=151936,
                               dtype=dtype)
    if name == "tiny":
        return tiny_mixed_specs()
    raise ValueError(f"unknown synthetic weight set {name!r}; choose one of {SYNTHETIC_SETS}")


def llama_specs(*, num_layers: int, hidden: int, intermediate: int, num_heads: int,
                num_kv_heads: int, head_dim: int, vocab: int,
                dtype: torch.dtype) -> list[TensorSpec]:
    """Hugging Face ``LlamaForCausalLM`` tensors (untied embeddings), in export order."""
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype)]
    for layer in range(num_layers):
        p = f"model.layers.{layer}"
        specs += [TensorSpec(f"{p}.input_layernorm.weight", (hidden,), dtype)]
        specs += _attention_specs(p, hidden=hidden, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        specs += [TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), dtype)]
        specs += _mlp_specs(f"{p}.mlp", hidden=hidden, intermediate=intermediate, dtype=dtype)
    return specs + _head_specs(hidden=hidden, vocab=vocab, dtype=dtype)


def qwen3_moe_specs(*, num_layers: int, hidden: int, num_experts: int, expert_hidden: int,
                    num_heads: int, num_kv_heads: int, head_dim: int, vocab: int,
                    dtype: torch.dtype) -> list[TensorSpec]:
    """Hugging Face ``Qwen3MoeForCausalLM`` tensors (per-expert weights), in export order."""
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype)]
    for layer in range(num_layers):
        p = f"model.layers.{layer}"
        specs += [TensorSpec(f"{p}.input_layernorm.weight", (hidden,), dtype)]
        specs += _attention_specs(p, hidden=hidden, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        specs += [
            TensorSpec(f"{p}.self_attn.q_norm.weight", (head_dim,), dtype),
            TensorSpec(f"{p}.self_attn.k_norm.weight", (head_dim,), dtype),
            TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), dtype),
            TensorSpec(f"{p}.mlp.gate.weight", (num_experts, hidden), dtype),
        ]
        for expert in range(num_experts):
            specs += _mlp_specs(f"{p}.mlp.experts.{expert}", hidden=hidden,
                                intermediate=expert_hidden, dtype=dtype)
    return specs + _head_specs(hidden=hidden, vocab=vocab, dtype=dtype)


def _attention_specs(prefix: str, *, hidden: int, num_heads: int, num_kv_heads: int,
                     head_dim: int, dtype: torch.dtype) -> list[TensorSpec]:
    a = f"{prefix}.self_attn"
    return [
        TensorSpec(f"{a}.q_proj.weight", (num_heads * head_dim, hidden), dtype),
        TensorSpec(f"{a}.k_proj.weight", (num_kv_heads * head_dim, hidden), dtype),
        TensorSpec(f"{a}.v_proj.weight", (num_kv_heads * head_dim, hidden), dtype),
        TensorSpec(f"{a}.o_proj.weight", (hidden, num_heads * head_dim), dtype),
    ]


def _mlp_specs(prefix: str, *, hidden: int, intermediate: int,
               dtype: torch.dtype) -> list[TensorSpec]:
    return [
        TensorSpec(f"{prefix}.gate_proj.weight", (intermediate, hidden), dtype),
        TensorSpec(f"{prefix}.up_proj.weight", (intermediate, hidden), dtype),
        TensorSpec(f"{prefix}.down_proj.weight", (hidden, intermediate), dtype),
    ]


def _head_specs(*, hidden: int, vocab: int, dtype: torch.dtype) -> list[TensorSpec]:
    return [TensorSpec("model.norm.weight", (hidden,), dtype),
            TensorSpec("lm_head.weight", (vocab, hidden), dtype)]


def tiny_mixed_specs() -> list[TensorSpec]:
    """Every dtype the transports must carry, odd sizes, a 0-dim and an empty tensor."""
    return [
        TensorSpec("embed.weight", (37, 16), torch.float32),
        TensorSpec("scale", (), torch.float32),
        TensorSpec("layers.0.attn.weight", (16, 48), torch.bfloat16),
        TensorSpec("layers.0.norm.weight", (17,), torch.float16),
        TensorSpec("layers.0.mlp.weight", (40, 16), torch.bfloat16),
        TensorSpec("layers.0.step", (3,), torch.int64),
        TensorSpec("layers.1.attn.weight", (16, 48), torch.bfloat16),
        TensorSpec("layers.1.empty", (0, 4), torch.float32),
        TensorSpec("layers.1.mlp.weight", (33, 7), torch.float16),
        TensorSpec("head.weight", (37, 16), torch.float32),
    ]


def random_tensor(spec: TensorSpec, *, device: torch.device,
                  generator: torch.Generator) -> torch.Tensor:
    """A tensor of ``spec``'s shape and dtype with deterministic random values."""
    tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    if spec.dtype.is_floating_point:
        tensor.normal_(generator=generator)
    elif spec.dtype == torch.bool:
        tensor.random_(0, 2, generator=generator)
    else:
        tensor.random_(0, 1 << 20, generator=generator)
    return tensor


class TensorListSource:
    """A ``WeightSource`` over tensors that already exist (views included, no copies)."""

    # The tensors are resident: they stay valid after the next one is yielded.
    stable_tensors = True

    def __init__(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        self._named = list(named_tensors)

    def weight_specs(self) -> list[TensorSpec]:
        return [TensorSpec.of(name, tensor) for name, tensor in self._named]

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._named


class SyntheticWeightSource(TensorListSource):
    """Random tensors for ``specs``, generated once on ``device`` and yielded every refit.

    ``noncontiguous=True`` stores every matrix transposed and yields a non-contiguous view of
    the planned shape, so packing is exercised on strided inputs.
    """

    def __init__(self, specs: Sequence[TensorSpec], *, device: torch.device, seed: int = 0,
                 noncontiguous: bool = False) -> None:
        device = torch.device(device)
        generator = torch.Generator(device=device).manual_seed(seed)
        named = []
        for spec in specs:
            if noncontiguous and len(spec.shape) == 2:
                flipped = TensorSpec(spec.name, spec.shape[::-1], spec.dtype)
                tensor = random_tensor(flipped, device=device, generator=generator).t()
            else:
                tensor = random_tensor(spec, device=device, generator=generator)
            named.append((spec.name, tensor))
        super().__init__(named)
