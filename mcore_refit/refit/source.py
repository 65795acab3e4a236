"""Weight sources: where a refit reads ``(hf_name, tensor)`` pairs from.

Two shapes of source, one protocol for the refit engine (:class:`RefitSource`):

- a :class:`WeightSource` lives on one rank and yields full tensors (``weight_specs()`` and
  ``iter_weights()``: the trainer-side contract of vLLM's weight-transfer subsystem, parameter
  metadata plus a full-tensor iterator). :class:`LocalSource` makes it a refit source whose every
  buffer comes from that rank;
- a sharded source (the Megatron model, :class:`~mcore_refit.refit.export.ModelExport`) is spread
  over the trainer ranks: each tensor has a *source rank* that produces it, and ranks help each
  other per buffer (tensor-parallel shards move to their source).

Per refit, :meth:`RefitSource.begin` gives a :class:`RefitPass`: every trainer rank calls its
``exchange(buffer)`` for every buffer of the plan in plan order, and a buffer's source rank pulls
the buffer's tensors from ``own_weights()`` after the buffer's exchange. Sources and passes may be
collectives over the trainer ranks: call them on every trainer rank, in the same order, or ranks
deadlock. :class:`SourceReader` pulls a pass's tensors in plan order and checks each one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mcore_refit.refit.plan import PlannedBuffer, PlannedTensor, RefitPlan
from mcore_refit.refit.specs import TensorSpec


@dataclass(frozen=True)
class Piecewise:
    """A tensor made of runs of other tensors along one dimension, never copied into one.

    A source yields it where an exported tensor's elements lie apart in the parameter (the
    query rows of each key-value group inside a fused QKV shard): ``runs[i]`` fills
    ``[offsets[i], offsets[i] + runs[i].shape[dim])`` of it along ``dim``. Packing copies each
    run straight into the buffer.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int
    offsets: Sequence[int]
    runs: Sequence[torch.Tensor]

    def copy_pairs(self, out: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(destinations, sources)``: where in ``out`` (this tensor's place) each run goes."""
        return ([out.narrow(self.dim, offset, run.shape[self.dim])
                 for offset, run in zip(self.offsets, self.runs, strict=True)], list(self.runs))

    def materialize(self) -> torch.Tensor:
        """A contiguous copy (verification only: it allocates)."""
        return torch.cat(list(self.runs), dim=self.dim)


@dataclass(frozen=True)
class SourceLayout:
    """What a refit source exports: every tensor's spec and source rank, grouped by source."""

    specs: list[TensorSpec]
    sources: list[int]


class RefitPass(Protocol):
    """One refit's pass over a source on one trainer rank (see the module docstring)."""

    # True when tensors from own_weights() stay valid while referenced (resident tensors), which
    # lets a buffer be packed with one batched copy per dtype.
    stable_tensors: bool

    def exchange(self, buffer: PlannedBuffer, *, timeout_s: float) -> None:
        """This rank's part in preparing ``buffer`` (may be a collective with its source)."""
        ...

    def own_weights(self) -> Iterator[tuple[str, torch.Tensor | Piecewise]]:
        """The tensors (or pieces) of the buffers this rank is the source of, in plan order; a
        tensor is valid until the next one is requested."""
        ...


class RefitSource(Protocol):
    """Anything the refit engine can plan for and read from."""

    def layout(self) -> SourceLayout:
        """Specs and source ranks (collective over the trainer ranks)."""
        ...

    def begin(self, plan: RefitPlan) -> RefitPass:
        """Start one refit's pass (collective over the trainer ranks)."""
        ...


class WeightSource(Protocol):
    """Full tensors on one rank, in a fixed order."""

    def weight_specs(self) -> list[TensorSpec]:
        """Specs of the tensors ``iter_weights`` yields, in the same order."""
        ...

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)``; a tensor is valid until the next item is requested."""
        ...


class LocalSource:
    """A :class:`WeightSource` on trainer rank ``rank`` as a refit source: every buffer is
    ``rank``'s, and other ranks (if any) have no part in it."""

    def __init__(self, source: WeightSource, *, rank: int = 0) -> None:
        self.source = source
        self.rank = rank

    def layout(self) -> SourceLayout:
        specs = self.source.weight_specs()
        return SourceLayout(specs=specs, sources=[self.rank] * len(specs))

    def begin(self, plan: RefitPlan) -> RefitPass:
        return _LocalPass(self.source)


class _LocalPass:
    def __init__(self, source: WeightSource) -> None:
        self._source = source
        self.stable_tensors = bool(getattr(source, "stable_tensors", False))

    def exchange(self, buffer: PlannedBuffer, *, timeout_s: float) -> None:
        pass

    def own_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._source.iter_weights()


class SourceReader:
    """Pulls a plan's tensors from a weight iterator in plan order, checking each one.

    Raises ``ValueError`` naming the first tensor that differs from the plan in name, shape or
    dtype, or the point where the source ended early. ``export_s`` accumulates the time spent
    inside the source (the export).
    """

    def __init__(self, plan: RefitPlan, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._plan = plan
        self._weights = weights
        self.export_s = 0.0

    def next_tensor(self, planned: PlannedTensor) -> torch.Tensor:
        start = time.perf_counter()
        item = next(self._weights, None)
        self.export_s += time.perf_counter() - start
        spec = planned.spec
        if item is None:
            raise ValueError(
                f"the weight source ended before {spec.name!r} (position {planned.index} of the "
                f"refit plan's {self._plan.num_tensors} tensors)"
            )
        name, tensor = item
        if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"the weight source yielded {name!r} {tuple(tensor.shape)} {tensor.dtype} at "
                f"position {planned.index}, the refit plan expects {spec.label!r} {spec.shape} "
                f"{spec.dtype}; rebuild the plan when the model changes"
            )
        return tensor

    def skip(self, planned: Sequence[PlannedTensor]) -> None:
        """Read and drop the source's next tensors for ``planned`` (after a failure, so that
        ranks reading a collective source in step are not left waiting)."""
        try:
            for _ in planned:
                if next(self._weights, None) is None:
                    return
        except Exception:
            pass  # the source itself failed: that error is already the refit's failure

    def extra(self) -> str | None:
        """The name of a tensor the source yields beyond the plan, if any."""
        item = next(self._weights, None)
        return None if item is None else item[0]

