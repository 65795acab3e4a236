"""Weight sources: where a refit reads ``(hf_name, tensor)`` pairs from.

A source is anything with ``weight_specs()`` and ``iter_weights()``; the refit engine never
needs more. This mirrors the trainer-side contract of vLLM's weight-transfer subsystem (parameter
metadata plus a full-tensor iterator), so an adapter to a stock engine stays thin.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one exported tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def num_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name=name, shape=tuple(tensor.shape), dtype=tensor.dtype)


class WeightSource(Protocol):
    """Full tensors in a fixed order, the same on every rank that iterates them.

    Both methods may be collectives (the Megatron export gathers across tensor- and
    pipeline-parallel ranks): call them on every trainer rank, in the same order, or ranks deadlock.
    """

    def weight_specs(self) -> list[TensorSpec]:
        """Specs of the tensors ``iter_weights`` yields, in the same order."""
        ...

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)``; a tensor is valid until the next item is requested."""
        ...


def drain(source: WeightSource) -> None:
    """Read one pass of ``source`` to its end and drop every tensor.

    For trainer ranks that take part in a collective export but send nothing.
    """
    for _ in source.iter_weights():
        pass


class BridgeWeightSource:
    """The Megatron model's weights in HF format, through Megatron-Bridge's export.

    Conversion tasks are built once and reused by :class:`~mcore_refit.model.ModelChunks`, and
    they reference the live parameters: every iteration reads the current weights (after optimizer
    steps, offload/onload or a checkpoint load). Both methods are collectives over the
    model-parallel groups: call them on every trainer rank, in the same order.
    """

    def __init__(self, model) -> None:
        self._model = model
        self._specs: list[TensorSpec] | None = None

    def weight_specs(self) -> list[TensorSpec]:
        """Specs of the exported tensors; the first call runs one export pass to learn them."""
        if self._specs is None:
            self._specs = [TensorSpec.of(name, tensor) for name, tensor in self.iter_weights()]
        return list(self._specs)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._model.export_hf_weights()
