"""transformers' fused mixture-of-experts tensors and the per-expert names checkpoints use.

transformers 5 holds a MoE layer's experts as two 3-D parameters (``modeling_qwen3_moe.py``,
``Qwen3MoeExperts``; the same layout for Qwen2-MoE, OLMoE, Mixtral-style models):

- ``<prefix>.experts.gate_up_proj`` ``[E, 2I, H]``: expert ``e``'s gate projection is rows
  ``[0, I)`` of ``gate_up_proj[e]`` and its up projection rows ``[I, 2I)`` (the forward does
  ``linear(x, gate_up_proj[e]).chunk(2, dim=-1)`` → gate, up);
- ``<prefix>.experts.down_proj`` ``[E, H, I]``: expert ``e``'s down projection, untransposed.

Checkpoints, and Megatron-Bridge's export, name every expert on its own
(``<prefix>.experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj.weight``, ``down_proj.weight``
``[H, I]``). :func:`expert_views` gives those per-expert tensors as views of a fused one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

_FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class ExpertSlice:
    """Where a per-expert tensor lies in a fused one: ``fused[expert]``, rows ``[start, stop)``
    of it when ``start`` is not None."""

    fused: str
    expert: int
    start: int | None = None
    stop: int | None = None

    def view(self, fused: torch.Tensor) -> torch.Tensor:
        """The per-expert tensor as a view of ``fused`` (shares its memory)."""
        tensor = fused[self.expert]
        return tensor if self.start is None else tensor[self.start:self.stop]


def is_fused(name: str) -> bool:
    """Whether ``name`` is a fused expert tensor of the layout above."""
    return _FUSED.match(name) is not None


def expert_slices(name: str, shape: tuple[int, ...]) -> dict[str, ExpertSlice]:
    """Per-expert name → slice for the fused tensor ``name`` of ``shape``; empty for a tensor
    that is not fused experts."""
    match = _FUSED.match(name)
    if match is None or len(shape) != 3:
        return {}
    prefix, kind = match["prefix"], match["kind"]
    num_experts = shape[0]
    if kind == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": ExpertSlice(name, e) for e in range(num_experts)}
    if shape[1] % 2 != 0:
        raise ValueError(f"{name}: a fused gate/up projection needs an even row count, got "
                         f"shape {tuple(shape)}")
    rows = shape[1] // 2
    slices = {}
    for e in range(num_experts):
        slices[f"{prefix}.{e}.gate_proj.weight"] = ExpertSlice(name, e, 0, rows)
        slices[f"{prefix}.{e}.up_proj.weight"] = ExpertSlice(name, e, rows, 2 * rows)
    return slices


def expert_views(named: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` with every fused expert tensor replaced by its per-expert views (other tensors
    pass through unchanged)."""
    for name, tensor in named:
        slices = expert_slices(name, tuple(tensor.shape))
        if not slices:
            yield name, tensor
            continue
        for expert_name, where in slices.items():
            yield expert_name, where.view(tensor)


def loading_options(dtype: torch.dtype) -> dict:
    """``from_pretrained`` keyword arguments for a model run in ``dtype``.

    transformers' default experts kernel (``grouped_mm``, ``integrations/moe.py``) calls
    ``torch.nn.functional.grouped_mm``, which expects bfloat16 on CUDA
    (``torch/_meta_registrations.py``: "Expected inputs of BF16 type"); its per-expert loop
    (``eager``) runs any dtype, and a dense model ignores the option.
    """
    return {} if dtype == torch.bfloat16 else {"experts_implementation": "eager"}
