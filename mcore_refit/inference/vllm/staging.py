"""Whole Hugging Face tensors assembled from a refit's buffers, in memory that outlives them.

vLLM's loader takes whole HF tensors, and its layerwise reload keeps a reference to each tensor
it is given until every weight of that tensor's layer has arrived (a layer may complete only at
``finish_weight_update``, e.g. an embedding padded beyond the vocabulary). A transport slot is
refilled as soon as its buffer was loaded, so a view of a slot handed to vLLM can be overwritten
while vLLM still holds it (measured: 3 of 39 tensors silently wrong). :class:`RefitStaging`
therefore copies every tensor, and every tensor-parallel piece into its region, out of the slot
on arrival, into one persistent allocation sized by the plan (each name at a fixed offset), and
hands vLLM views of that. Nothing in it is rewritten before the next refit, which starts only
after vLLM has finished the previous one; a steady-state refit allocates nothing here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mcore_refit.refit import RefitPlan
from mcore_refit.refit.plan import Region

# Offsets of tensors in the staging allocation (bytes): enough for any dtype and vector loads.
_ALIGNMENT = 64


class RefitStaging:
    """One persistent ``uint8`` allocation holding every tensor of ``plan`` whole, by name.

    Per refit: :meth:`begin`, then :meth:`put` / :meth:`put_pieces` per received buffer, each
    returning the ``(name, tensor)`` pairs that became whole with it (a tensor sent in pieces is
    whole once pieces covering all of it arrived). The returned tensors stay valid and unchanged
    until the next :meth:`begin`.
    """

    def __init__(self, plan: RefitPlan, device: torch.device) -> None:
        shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        for spec in plan.specs():
            shape = list(spec.shape)
            if spec.region is not None:
                shape[spec.region.dim] = spec.region.full
            shapes.setdefault(spec.name, (torch.Size(shape), spec.dtype))
        offsets, end = {}, 0
        for name, (shape, dtype) in shapes.items():
            offsets[name] = end
            end += -(-shape.numel() * dtype.itemsize // _ALIGNMENT) * _ALIGNMENT
        self.fingerprint = plan.fingerprint
        self.nbytes = end
        self._memory = torch.empty(max(end, 1), dtype=torch.uint8, device=device)
        self._tensors = {
            name: self._memory[offsets[name]:offsets[name] + shape.numel() * dtype.itemsize]
            .view(dtype).view(shape)
            for name, (shape, dtype) in shapes.items()}
        self._missing: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    @property
    def complete(self) -> bool:
        """Every planned tensor is whole (in this refit)."""
        return not any(self._missing.values())

    def begin(self) -> None:
        """Start a refit: every tensor is missing all its elements again."""
        self._missing = {name: tensor.numel() for name, tensor in self._tensors.items()}

    def tensor(self, name: str) -> torch.Tensor:
        """The staged tensor ``name`` (as last received)."""
        try:
            return self._tensors[name]
        except KeyError:
            raise ValueError(f"{name!r} is not a tensor of the refit plan") from None

    def put(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Copy whole tensors in (one batched copy per dtype); returns them as staged."""
        destinations, sources, counts = [], [], []
        for name, tensor in weights:
            target = self.tensor(name)
            if target.shape != tensor.shape or target.dtype != tensor.dtype:
                raise ValueError(f"weight {name!r}: received {tuple(tensor.shape)} "
                                 f"{tensor.dtype}, the plan has {tuple(target.shape)} "
                                 f"{target.dtype}")
            destinations.append(target)
            sources.append(tensor)
            counts.append((name, tensor.numel()))
        self._copy(destinations, sources)
        return self._arrived(counts)

    def put_pieces(self, pieces: Iterable[tuple[str, torch.Tensor, Region]]
                   ) -> list[tuple[str, torch.Tensor]]:
        """Copy each piece into its region of its tensor; returns the tensors now whole."""
        destinations, sources, counts = [], [], []
        for name, piece, region in pieces:
            target = self.tensor(name)
            shape = list(target.shape)
            if 0 <= region.dim < len(shape) and shape[region.dim] == region.full:
                shape[region.dim] = piece.shape[region.dim]
            fits = (piece.dim() == target.dim() and list(piece.shape) == shape
                    and region.start + piece.shape[region.dim] <= region.full)
            if not fits or piece.dtype != target.dtype:
                raise ValueError(f"weight {name!r}: received a piece {tuple(piece.shape)} "
                                 f"{piece.dtype} at {region}, the plan has "
                                 f"{tuple(target.shape)} {target.dtype}")
            destinations.append(region.narrow(target, piece.shape[region.dim]))
            sources.append(piece)
            counts.append((name, piece.numel()))
        self._copy(destinations, sources)
        return self._arrived(counts)

    def _arrived(self, counts: list[tuple[str, int]]) -> list[tuple[str, torch.Tensor]]:
        whole = []
        for name, numel in counts:
            left = self._missing.get(name, 0) - numel
            if left < 0:
                raise ValueError(f"weight {name!r} arrived more often than the plan sends it "
                                 "in this refit")
            self._missing[name] = left
            if left == 0:
                whole.append((name, self._tensors[name]))
        return whole

    @staticmethod
    def _copy(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for destination, source in zip(destinations, sources, strict=True):
            into, out_of = by_dtype.setdefault(destination.dtype, ([], []))
            into.append(destination)
            out_of.append(source)
        with torch.no_grad():
            for into, out_of in by_dtype.values():
                torch._foreach_copy_(into, out_of)
