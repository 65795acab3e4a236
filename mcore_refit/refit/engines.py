"""Reference inference-engine adapters: copy received weights into named tensors.

:class:`NamedTensorEngine` is the ``load_weights`` / ``get_weight`` convention over a mapping of
name → tensor. :class:`HFModelEngine` applies it to a Hugging Face ``transformers`` model (its
parameters and buffers by state-dict name, tied weights under every name they have);
:class:`TensorDictEngine` holds preallocated tensors (benchmarks, tests).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from mcore_refit.refit.plan import TensorSpec


class NamedTensorEngine:
    """Copies ``(name, tensor)`` pairs into the tensor of that name; checks shapes and dtypes.

    A ``load_weights`` call validates every pair before copying any, so a bad name leaves this
    call's targets untouched; copies are batched per dtype on the current stream.
    """

    def __init__(self, targets: Mapping[str, torch.Tensor], *, description: str) -> None:
        self._targets = dict(targets)
        self._description = description

    @property
    def names(self) -> list[str]:
        return list(self._targets)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        batches: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        targets = self._targets
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                raise ValueError(
                    f"unknown weight name {name!r}: {self._description} has no parameter or "
                    "buffer of that name"
                )
            if target.shape != tensor.shape or target.dtype != tensor.dtype:
                raise ValueError(
                    f"weight {name!r}: received {tuple(tensor.shape)} {tensor.dtype}, "
                    f"{self._description} holds {tuple(target.shape)} {target.dtype}"
                )
            destinations, sources = batches.setdefault(target.dtype, ([], []))
            destinations.append(target)
            sources.append(tensor)
        with torch.no_grad():
            for destinations, sources in batches.values():
                torch._foreach_copy_(destinations, sources)

    def get_weight(self, name: str) -> torch.Tensor:
        target = self._targets.get(name)
        if target is None:
            raise ValueError(f"unknown weight name {name!r} in {self._description}")
        return target.detach()


class TensorDictEngine(NamedTensorEngine):
    """An engine that is just preallocated tensors (what a benchmark receiver copies into)."""

    @classmethod
    def from_specs(cls, specs: Sequence[TensorSpec], *, device: torch.device) -> TensorDictEngine:
        targets = {s.name: torch.zeros(s.shape, dtype=s.dtype, device=device) for s in specs}
        return cls(targets, description=f"the tensor-dict engine on {device}")


class HFModelEngine(NamedTensorEngine):
    """A Hugging Face ``transformers`` model as a refit target, by state-dict name."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model.state_dict(keep_vars=True),
                         description=f"the {type(model).__name__} model")
        self.model = model
