"""The small interface every refit transport implements, and the errors they raise.

A transport has a trainer end (:class:`RefitSender`) and an engine end (:class:`RefitReceiver`).
Both hold the same :class:`~mcore_refit.refit.plan.RefitPlan`; ``send`` and ``receive`` move one
refit's tensors and return its :class:`~mcore_refit.refit.telemetry.RefitTelemetry`. A failure on
either end raises :class:`RefitError` on both ends (never a one-sided hang); every wait is bounded
and a :class:`RefitTimeout` names what it waited for.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import ClassVar, Protocol, runtime_checkable

import torch

from mcore_refit.refit.plan import RefitPlan
from mcore_refit.refit.telemetry import RefitTelemetry


class RefitError(RuntimeError):
    """A refit failed. Raised on every participating rank; the engine's weights may be partial."""


class RefitTimeout(RefitError):
    """A bounded wait inside a refit expired; the message names what was awaited."""


class WeightLoader(Protocol):
    """What an inference engine needs for a refit (the vLLM / HF ``load_weights`` convention)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each ``(name, tensor)`` into the engine's weights. Tensors are views into a
        transport buffer, valid only during the call: copy, never keep a reference."""
        ...


@runtime_checkable
class WeightReader(Protocol):
    """Read-back of loaded weights by name, for the post-refit equality check."""

    def get_weight(self, name: str) -> torch.Tensor:
        ...


class RefitSender(ABC):
    """Trainer end of a transport for one plan. Owns its buffers; call :meth:`close` when done."""

    transport_name: ClassVar[str]

    def __init__(self, *, plan: RefitPlan) -> None:
        self.plan = plan

    @abstractmethod
    def prepare(self) -> None:
        """Allocate buffers and meet the receiving end; call once before the first :meth:`send`."""

    @abstractmethod
    def send(self, weights: Iterator[tuple[str, torch.Tensor]], *, refit_index: int,
             verify: bool = False, stable_tensors: bool = False) -> RefitTelemetry:
        """Move one refit: ``weights`` yields the plan's tensors in plan order.

        With ``verify`` the engine's weights are compared with what was sent, after loading.
        ``stable_tensors`` promises that yielded tensors stay valid while referenced (not
        overwritten by later items), which allows batching a buffer's copies. Raises
        :class:`RefitError` when any end failed. All device work is complete on return.
        """

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


class DrainSender(RefitSender):
    """For trainer ranks that take part in the export but send nothing.

    The Megatron export is collective across trainer ranks: every rank must iterate the source in
    lockstep, so ranks other than the refit source drain it.
    """

    transport_name = "drain"

    def prepare(self) -> None:
        pass

    def send(self, weights: Iterator[tuple[str, torch.Tensor]], *, refit_index: int,
             verify: bool = False, stable_tensors: bool = False) -> RefitTelemetry:
        start = time.perf_counter()
        count = sum(1 for _ in weights)
        elapsed = time.perf_counter() - start
        if count != self.plan.num_tensors:
            raise RefitError(
                f"the weight source yielded {count} tensors, the refit plan has "
                f"{self.plan.num_tensors}"
            )
        return RefitTelemetry(role="sender", transport=self.transport_name,
                              refit_index=refit_index, device="n/a", num_tensors=count,
                              num_buffers=0, bytes=0, total_s=elapsed, export_s=elapsed)
