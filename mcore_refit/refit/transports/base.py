"""The small interface every refit transport implements: a sender and a receiver.

A transport has a trainer end (:class:`RefitSender`) and an engine end (:class:`RefitReceiver`).
Both hold the same :class:`~mcore_refit.refit.plan.RefitPlan`; ``send`` and ``receive`` move one
refit's tensors and return its :class:`~mcore_refit.refit.telemetry.RefitTelemetry`. A failure on
either end raises :class:`~mcore_refit.refit.errors.RefitError` on both ends (never a one-sided
hang); every wait is bounded and a :class:`~mcore_refit.refit.errors.RefitTimeout` names what it
waited for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from mcore_refit.refit.engines import WeightLoader
from mcore_refit.refit.plan import RefitPlan
from mcore_refit.refit.source import RefitPass
from mcore_refit.refit.telemetry import RefitTelemetry


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
