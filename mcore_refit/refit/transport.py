"""The small interface every refit transport implements, and the errors they raise.

A transport has a trainer end (:class:`RefitSender`) and an engine end (:class:`RefitReceiver`).
Both hold the same :class:`~mcore_refit.refit.plan.RefitPlan`; ``send`` and ``receive`` move one
refit's tensors and return its :class:`~mcore_refit.refit.telemetry.RefitTelemetry`. A failure on
either end raises :class:`RefitError` on both ends (never a one-sided hang); every wait is bounded
and a :class:`RefitTimeout` names what it waited for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import ClassVar, Protocol

import torch

from mcore_refit.refit.plan import RefitPlan, Region, TensorSpec
from mcore_refit.refit.source import RefitPass
from mcore_refit.refit.telemetry import RefitTelemetry


class RefitError(RuntimeError):
    """A refit failed. Raised on every participating rank; the engine's weights may be partial."""


class RefitTimeout(RefitError):
    """A bounded wait inside a refit expired; the message names what was awaited."""


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


def load_into(engine: WeightLoader, entries: Sequence[tuple[TensorSpec, torch.Tensor]]) -> None:
    """Hand one buffer's tensors to ``engine``: whole ones through ``load_weights``, pieces
    through ``load_weight_pieces``."""
    wholes = [(spec.name, view) for spec, view in entries if spec.region is None]
    pieces = [(spec.name, view, spec.region) for spec, view in entries
              if spec.region is not None]
    if wholes:
        engine.load_weights(wholes)
    if pieces:
        load_pieces = getattr(engine, "load_weight_pieces", None)
        if load_pieces is None:
            raise RefitError(f"the engine ({type(engine).__name__}) has no load_weight_pieces, "
                             f"but the trainer sends {pieces[0][0]!r} in pieces (tensor "
                             "parallelism): add it, or refit from an engine that assembles them")
        load_pieces(pieces)


class RefitSender(ABC):
    """Trainer end of a transport for one plan. Owns its buffers; call :meth:`close` when done."""

    transport_name: ClassVar[str]

    def __init__(self, *, plan: RefitPlan) -> None:
        self.plan = plan

    @abstractmethod
    def prepare(self) -> None:
        """Allocate buffers and meet the receiving end; call once before the first :meth:`send`."""

    @abstractmethod
    def send(self, refit_pass: RefitPass, *, refit_index: int,
             verify: bool = False) -> RefitTelemetry:
        """Move one refit: this rank's part of ``refit_pass`` for every buffer of the plan.

        With ``verify`` the engine's weights are compared with what was exported, after
        loading. Raises :class:`RefitError` when any end failed. All device work is complete on
        return.
        """

    @property
    def held_bytes(self) -> int:
        """Device bytes this end holds for its slots."""
        return 0

    def close(self) -> None:  # noqa: B027 (optional hook: not every end holds resources)
        """Release buffers and connections. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class RefitReceiver(ABC):
    """Engine end of a transport. Owns its buffers; call :meth:`close` when done."""

    transport_name: ClassVar[str]

    @abstractmethod
    def prepare(self) -> None:
        """Allocate buffers or connect; call once before the first :meth:`receive`."""

    @abstractmethod
    def receive(self, engine: WeightLoader) -> RefitTelemetry:
        """Receive one refit into ``engine`` (blocks until the trainer's refit completed)."""

    @property
    @abstractmethod
    def plan(self) -> RefitPlan | None:
        """The plan in use (``None`` until the trainer sent it)."""

    def close(self) -> None:  # noqa: B027 (optional hook: not every end holds resources)
        """Release buffers and connections. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
