"""What a receiving engine must provide (:class:`WeightLoader`), and reference engines.

Transports hand every received buffer to the engine with :func:`load_into`: whole tensors through
``load_weights``, tensor-parallel pieces through ``load_weight_pieces``. Where the tensors stay
valid longer than the call, an engine may read them without a copy of its own: a transport
passes ``held=True`` for a buffer whose slot is not refilled before the refit ends (``held``
engines have ``load_weights_held``), and ``in_place=True`` for the whole refit in the trainer's
own memory, shared (``load_weights_in_place``).

:class:`NamedTensorEngine` is the ``load_weights`` / ``get_weight`` convention over a mapping of
name → tensor. :class:`HFModelEngine` applies it to a Hugging Face ``transformers`` model (its
parameters and buffers by state-dict name, tied weights under every name they have, fused MoE
experts under their per-expert checkpoint names);
:class:`TensorDictEngine` holds preallocated tensors (benchmarks, tests).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import torch

from mcore_refit.hf_experts import ExpertSlice, expert_slices
from mcore_refit.refit.errors import RefitError
from mcore_refit.refit.specs import Region, TensorSpec


class WeightLoader(Protocol):
    """What an inference engine needs for a refit (the vLLM / HF ``load_weights`` convention).

    Tensors are views into a transport buffer, valid only during the call: copy, never keep a
    reference. Trainers with tensor parallelism send a sharded tensor in pieces, one from each
    rank that holds a shard; those arrive through ``load_weight_pieces``.
    """

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each whole ``(name, tensor)`` into the engine's weights."""
        ...

    def load_weight_pieces(self, pieces: Iterable[tuple[str, torch.Tensor, Region]]) -> None:
        """Copy each ``(name, piece, region)`` into its region of the named weight."""
        ...


def load_into(engine: WeightLoader, entries: Sequence[tuple[TensorSpec, torch.Tensor]], *,
              held: bool = False, in_place: bool = False) -> None:
    """Hand one buffer's tensors to ``engine``: whole ones through ``load_weights``, pieces
    through ``load_weight_pieces``.

    ``held``: ``entries`` stay valid and unchanged until the refit ends (their slot is not
    refilled before). An engine with ``load_weights_held(wholes, pieces)`` then gets them there
    and may keep reading them after the call, uncopied; it must have finished when the refit
    ends (before the transport's last reply to the trainer).
    ``in_place``: ``entries`` are every tensor of the refit, valid and unchanged until this
    returns. An engine with ``load_weights_in_place(wholes, pieces)`` then gets them in one
    call and may load from them without copying them first; it must have finished reading them
    when that call returns."""
    wholes = [(spec.name, view) for spec, view in entries if spec.region is None]
    pieces = [(spec.name, view, spec.region) for spec, view in entries
              if spec.region is not None]
    name = "load_weights_in_place" if in_place else "load_weights_held" if held else None
    load_uncopied = getattr(engine, name, None) if name is not None else None
    if load_uncopied is not None:
        load_uncopied(wholes, pieces)
        return
    if wholes:
        engine.load_weights(wholes)
    if pieces:
        load_pieces = getattr(engine, "load_weight_pieces", None)
        if load_pieces is None:
            raise RefitError(f"the engine ({type(engine).__name__}) has no load_weight_pieces, "
                             f"but the trainer sends {pieces[0][0]!r} in pieces (tensor "
                             "parallelism): add it, or refit from an engine that assembles them")
        load_pieces(pieces)


def check_received(name: str, tensor: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
                   *, expected_by: str) -> None:
    """Raise unless the whole tensor received as ``name`` has ``shape`` and ``dtype``, naming
    them as what ``expected_by`` holds (e.g. "the Llama model holds")."""
    if tensor.shape != tuple(shape) or tensor.dtype != dtype:
        raise ValueError(f"weight {name!r}: received {tuple(tensor.shape)} {tensor.dtype}, "
                         f"{expected_by} {tuple(shape)} {dtype}")


class NamedTensorEngine:
    """Copies ``(name, tensor)`` pairs into the tensor of that name; checks shapes and dtypes.

    A ``load_weights`` (or ``load_weight_pieces``) call validates every pair before copying any,
    so a bad name leaves this call's targets untouched; copies are batched per dtype on the
    current stream.
    """

    def __init__(self, targets: Mapping[str, torch.Tensor], *, description: str) -> None:
        self._targets = dict(targets)
        self._description = description

    @property
    def names(self) -> list[str]:
        return list(self._targets)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        batches: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for name, tensor in weights:
            target = self._target(name)
            check_received(name, tensor, target.shape, target.dtype,
                           expected_by=f"{self._description} holds")
            destinations, sources = batches.setdefault(target.dtype, ([], []))
            destinations.append(target)
            sources.append(tensor)
        with torch.no_grad():
            for destinations, sources in batches.values():
                torch._foreach_copy_(destinations, sources)

    def load_weight_pieces(self, pieces: Iterable[tuple[str, torch.Tensor, Region]]) -> None:
        """Copy each piece into its region of the named tensor; checked like ``load_weights``."""
        batches: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for name, piece, region in pieces:
            target = self._target(name)
            shape = list(target.shape)
            if 0 <= region.dim < len(shape) and shape[region.dim] == region.full:
                shape[region.dim] = piece.shape[region.dim]
            fits = (piece.dim() == target.dim() and list(piece.shape) == shape
                    and region.start + piece.shape[region.dim] <= region.full)
            if not fits or piece.dtype != target.dtype:
                raise ValueError(
                    f"weight {name!r}: received a piece {tuple(piece.shape)} {piece.dtype} at "
                    f"{region}, {self._description} holds {tuple(target.shape)} {target.dtype}")
            destinations, sources = batches.setdefault(target.dtype, ([], []))
            destinations.append(region.narrow(target, piece.shape[region.dim]))
            sources.append(piece)
        with torch.no_grad():
            for destinations, sources in batches.values():
                torch._foreach_copy_(destinations, sources)

    def get_weight(self, name: str) -> torch.Tensor:
        target = self._lookup(name)
        if target is None:
            raise ValueError(f"unknown weight name {name!r} in {self._description}")
        return target.detach()

    def _lookup(self, name: str) -> torch.Tensor | None:
        return self._targets.get(name)

    def _target(self, name: str) -> torch.Tensor:
        target = self._lookup(name)
        if target is None:
            raise ValueError(f"unknown weight name {name!r}: {self._description} has no "
                             "parameter or buffer of that name")
        return target


class TensorDictEngine(NamedTensorEngine):
    """An engine that is just preallocated tensors (what a benchmark receiver copies into)."""

    @classmethod
    def from_specs(cls, specs: Sequence[TensorSpec], *, device: torch.device) -> TensorDictEngine:
        """Zero tensors for ``specs`` (pieces stand for their whole tensor)."""
        targets = {spec.name: torch.zeros(spec.whole_shape, dtype=spec.dtype, device=device)
                   for spec in specs}
        return cls(targets, description=f"the tensor-dict engine on {device}")


class HFModelEngine(NamedTensorEngine):
    """A Hugging Face ``transformers`` model as a refit target, by state-dict name.

    transformers holds a MoE layer's experts fused (``mlp.experts.gate_up_proj``,
    ``down_proj``); the trainer exports them expert by expert under the checkpoint's names
    (``mlp.experts.3.gate_proj.weight``), which are written into their rows of the fused
    parameter (a view made at each lookup, so it follows the parameter's ``.data`` when the
    engine releases and reacquires its memory).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        state = model.state_dict(keep_vars=True)
        super().__init__(state, description=f"the {type(model).__name__} model")
        self.model = model
        self._experts: dict[str, ExpertSlice] = {}
        for name, tensor in state.items():
            self._experts.update(expert_slices(name, tuple(tensor.shape)))

    def _lookup(self, name: str) -> torch.Tensor | None:
        target = self._targets.get(name)
        if target is not None:
            return target
        where = self._experts.get(name)
        if where is None:
            return None
        return where.view(self._targets[where.fused].detach())
