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

from mcore_refit.refit import NamedTensorEngine, RefitPlan, Region, packed_offsets, typed_view

# Offsets of tensors in the staging allocation (bytes): enough for any dtype and vector loads.
_ALIGNMENT = 64


class RefitStaging:
    """One persistent ``uint8`` allocation holding every tensor of ``plan`` whole, by name (or
    only those of ``names``).

    Per refit: :meth:`begin`, then :meth:`put` / :meth:`put_pieces` per received buffer, each
    returning the ``(name, tensor)`` pairs that became whole with it (a tensor sent in pieces is
    whole once pieces covering all of it arrived). The returned tensors stay valid and unchanged
    until the next :meth:`begin`.
    """

    def __init__(self, plan: RefitPlan, device: torch.device,
                 names: frozenset[str] | None = None) -> None:
        shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        for spec in plan.specs():
            if names is not None and spec.name not in names:
                continue
            shape = list(spec.shape)
            if spec.region is not None:
                shape[spec.region.dim] = spec.region.full
            shapes.setdefault(spec.name, (torch.Size(shape), spec.dtype))
        if names is not None and len(shapes) != len(names):
            unknown = sorted(names - shapes.keys())
            raise ValueError(f"{len(unknown)} tensors to stage are not in the plan: "
                             f"{unknown[:5]}")
        offsets, end = packed_offsets(list(shapes.values()), alignment=_ALIGNMENT)
        self.fingerprint = plan.fingerprint
        self.selection = names  # None: every tensor of the plan
        self.nbytes = end
        self._memory = torch.empty(max(end, 1), dtype=torch.uint8, device=device)
        self._tensors = {name: typed_view(self._memory, offset, shape, dtype)
                         for (name, (shape, dtype)), offset in zip(shapes.items(), offsets,
                                                                   strict=True)}
        # Checked, batched copies into the staged tensors (by name, pieces into their regions).
        self._copies = NamedTensorEngine(self._tensors, description="the refit's staging")
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
        return self._copies.get_weight(name)

    def put(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Copy whole tensors in (checked, one batched copy per dtype); returns them staged."""
        weights = list(weights)
        self._copies.load_weights(weights)
        return self._arrived([(name, tensor.numel()) for name, tensor in weights])

    def put_pieces(self, pieces: Iterable[tuple[str, torch.Tensor, Region]]
                   ) -> list[tuple[str, torch.Tensor]]:
        """Copy each piece into its region of its tensor; returns the tensors now whole."""
        pieces = list(pieces)
        self._copies.load_weight_pieces(pieces)
        return self._arrived([(name, piece.numel()) for name, piece, _ in pieces])

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
