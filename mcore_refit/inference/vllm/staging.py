"""Whole Hugging Face tensors of a refit, in memory that outlives the slots they came in.

vLLM's loader takes whole HF tensors, and its layerwise reload keeps a reference to each tensor
it is given until every weight of that tensor's layer has arrived (a layer may complete only at
``finish_weight_update``, e.g. an embedding padded beyond the vocabulary). A transport slot
refilled within a refit can therefore be overwritten while vLLM still holds a view of it
(measured: 3 of 39 tensors silently wrong). :class:`RefitStaging` copies such tensors, and every
tensor-parallel piece into its region, out of the slot on arrival, into one persistent
allocation sized by the plan (each name at a fixed offset), and hands vLLM views of that.
Tensors whose memory stays valid and unchanged until the refit ends (the trainer's own
parameters, or a slot of its own for every buffer, so that nothing is refilled) are *referred*
to instead: kept by reference, never copied. Nothing is rewritten before the next refit, which
starts only after vLLM has finished the previous one; a steady-state refit allocates nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mcore_refit.refit import (
    NamedTensorEngine,
    RefitPlan,
    Region,
    check_received,
    packed_offsets,
    typed_view,
)

# Offsets of tensors in the staging allocation (bytes): enough for any dtype and vector loads.
_ALIGNMENT = 64


class RefitStaging:
    """Every tensor of ``plan`` whole, by name, for one refit at a time: those of ``copied``
    (``None``: all) are copied into one persistent ``uint8`` allocation sized for them, the
    others are referred to (:meth:`refer`).

    Per refit: :meth:`begin`, then :meth:`put` / :meth:`put_pieces` / :meth:`refer` per received
    buffer, each returning the ``(name, tensor)`` pairs that became whole with it (a tensor sent
    in pieces is whole once pieces covering all of it arrived). The returned tensors stay valid
    and unchanged until the next :meth:`begin` (referred ones: as long as their caller keeps
    them so).
    """

    def __init__(self, plan: RefitPlan, device: torch.device,
                 copied: frozenset[str] | None = None) -> None:
        shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        for spec in plan.specs():
            shapes.setdefault(spec.name, (torch.Size(spec.whole_shape), spec.dtype))
        if copied is not None and not copied <= shapes.keys():
            unknown = sorted(copied - shapes.keys())
            raise ValueError(f"{len(unknown)} tensors to stage are not in the plan: "
                             f"{unknown[:5]}")
        allocated = {name: shape for name, shape in shapes.items()
                     if copied is None or name in copied}
        offsets, end = packed_offsets(list(allocated.values()), alignment=_ALIGNMENT)
        self.fingerprint = plan.fingerprint
        self.copied = copied  # None: every tensor of the plan
        self.nbytes = end
        self._shapes = shapes
        self._memory = torch.empty(max(end, 1), dtype=torch.uint8, device=device)
        self._tensors = {name: typed_view(self._memory, offset, shape, dtype)
                         for (name, (shape, dtype)), offset in zip(allocated.items(), offsets,
                                                                   strict=True)}
        # Checked, batched copies into the staged tensors (by name, pieces into their regions).
        self._copies = NamedTensorEngine(self._tensors, description="the refit's staging")
        self._referred: dict[str, torch.Tensor] = {}
        self._missing: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        return list(self._shapes)

    @property
    def complete(self) -> bool:
        """Every planned tensor is whole (in this refit)."""
        return not any(self._missing.values())

    def begin(self) -> None:
        """Start a refit: every tensor is missing all its elements again, and the tensors
        referred to in the last one are let go."""
        self._referred.clear()
        self._missing = {name: shape.numel() for name, (shape, _) in self._shapes.items()}

    def release(self) -> None:
        """Let go of the tensors referred to (the caller's memory is about to change)."""
        self._referred.clear()

    def referred(self, name: str) -> bool:
        """``name`` arrived by reference in this refit (see :meth:`refer`)."""
        return name in self._referred

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as last received (staged, or referred to)."""
        if name in self._referred:
            return self._referred[name]
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

    def refer(self, weights: Iterable[tuple[str, torch.Tensor]]
              ) -> list[tuple[str, torch.Tensor]]:
        """Take whole tensors by reference, uncopied: their memory must stay valid and
        unchanged until the next :meth:`begin` (or :meth:`release`). Returns them."""
        weights = list(weights)
        for name, tensor in weights:
            if name not in self._shapes:
                raise ValueError(f"unknown weight name {name!r}: the refit's plan has no "
                                 "tensor of that name")
            shape, dtype = self._shapes[name]
            check_received(name, tensor, shape, dtype, expected_by="the refit's plan has")
        self._referred.update(weights)
        return self._arrived([(name, tensor.numel()) for name, tensor in weights])

    def _arrived(self, counts: list[tuple[str, int]]) -> list[tuple[str, torch.Tensor]]:
        whole = []
        for name, numel in counts:
            left = self._missing.get(name, 0) - numel
            if left < 0:
                raise ValueError(f"weight {name!r} arrived more often than the plan sends it "
                                 "in this refit")
            self._missing[name] = left
            if left == 0:
                whole.append(name)
        return [(name, self.tensor(name)) for name in whole]
