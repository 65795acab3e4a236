"""The engine side of refits, with the call names of vLLM's weight-transfer subsystem.

An inference engine process wraps its model in a
:class:`~mcore_refit.refit.engines.WeightLoader` (e.g.
:class:`~mcore_refit.refit.engines.HFModelEngine`) and drives a :class:`WeightTransferEndpoint`:

    endpoint.init_weight_transfer_engine(ColocatedInitInfo(address=...))   # once
    endpoint.start_weight_update()                                   # per refit
    endpoint.update_weights()            # blocks until the trainer's refit completed
    endpoint.finish_weight_update(weight_version=step)

The transport turns every received buffer into ``(name, view)`` pairs and calls
``load_weights``; the endpoint tracks the weight version and refuses to finish an update that
failed, so a half-loaded model is never labelled with a new version.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from mcore_refit.control import ControlGroup
from mcore_refit.refit.config import TransportOptions
from mcore_refit.refit.engines import WeightLoader
from mcore_refit.refit.errors import RefitError
from mcore_refit.refit.plan import RefitPlan
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transports import create_receiver
from mcore_refit.refit.transports.base import RefitReceiver
from mcore_refit.refit.transports.non_colocated.placement import Placement

logger = logging.getLogger(__name__)


class _InitInfo:
    """Init info names its transport (a registry name) and the receiver's own arguments."""

    transport: ClassVar[str]

    def receiver_arguments(self) -> dict[str, Any]:
        raise NotImplementedError

    def connect(self, *, device: torch.device, options: TransportOptions,
                plan: RefitPlan | None) -> RefitReceiver:
        """The engine end of the transport (not yet prepared)."""
        return create_receiver(self.transport, device=device, options=options, plan=plan,
                               **self.receiver_arguments())

    def open(self, *, device: torch.device, options: TransportOptions,
             plan: RefitPlan | None) -> RefitReceiver:
        """The engine end of the transport, prepared (for ``non_colocated`` a collective with
        the trainer's ``prepare()``); closed again if preparing fails."""
        receiver = self.connect(device=device, options=options, plan=plan)
        try:
            receiver.prepare()
        except BaseException:
            receiver.close()
            raise
        return receiver


@dataclass(frozen=True, kw_only=True)
class ColocatedInitInfo(_InitInfo):
    """Colocated: the trainer's socket address (``ColocatedSender.address``)."""

    transport: ClassVar[str] = "colocated"
    address: str

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address.startswith("ipc://"):
            raise ValueError(f"init_info.address must be an ipc:// address, got {self.address!r}")

    def receiver_arguments(self) -> dict[str, Any]:
        return {"address": self.address}


@dataclass(frozen=True, kw_only=True)
class NonColocatedInitInfo(_InitInfo):
    """Non-colocated: where this inference rank sits in the non-colocated job, and its groups."""

    transport: ClassVar[str] = "non_colocated"
    placement: Placement
    # This inference rank's index among the inference ranks.
    receiver: int
    # Control plane over every rank of the job (trainer ranks first).
    control: ControlGroup
    # Source trainer rank -> its data group, for the sources that broadcast to this rank.
    data_groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    # refit.transport.fanout=relay or direct: this rank's two-rank links by (from, to) job rank.
    links: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.receiver < self.placement.num_receivers:
            raise ValueError(f"init_info.receiver={self.receiver} is not an inference rank of "
                             f"the placement ({self.placement.num_receivers} inference ranks)")

    def receiver_arguments(self) -> dict[str, Any]:
        return {"placement": self.placement, "receiver": self.receiver, "control": self.control,
                "data_groups": self.data_groups, "links": self.links}


InitInfo = ColocatedInitInfo | NonColocatedInitInfo

# Transports whose init info is plain data (what an engine process receives), by name.
_PLAIN_INIT_INFO = {"colocated": ColocatedInitInfo, "colocated_weights": ColocatedInitInfo}


def init_info_from_dict(data: Mapping[str, Any]) -> ColocatedInitInfo:
    """Parse plain-data init info, ``{"transport": "colocated", "address": ...}`` (the form an
    engine process receives; the non-colocated transport's groups are live objects, not data)."""
    data = dict(data)
    transport = data.pop("transport", None)
    if transport not in _PLAIN_INIT_INFO:
        choices = ", ".join(repr(name) for name in _PLAIN_INIT_INFO)
        raise ValueError(f"init_info.transport must be one of {choices} (the non_colocated "
                         f"transport takes a NonColocatedInitInfo), got {transport!r}")
    unknown = sorted(set(data) - {"address"})
    if unknown:
        raise ValueError(f"unknown init_info key '{unknown[0]}' for transport {transport!r} "
                         "(known: address)")
    if "address" not in data:
        raise ValueError(f"init_info for transport {transport!r} lacks 'address'")
    return _PLAIN_INIT_INFO[transport](**data)


class EngineEndpoint(ABC):
    """The engine side's calls, in vLLM's names and order, whatever carries them: connect once
    (:meth:`init_weight_transfer_engine`), then per refit :meth:`start_weight_update`,
    :meth:`update_weights`, :meth:`finish_weight_update`. Keeps the weight version and refuses
    to label an update that failed. Subclasses say how each call reaches the receiver."""

    # Whose weights a failed update leaves partial, in its error.
    weights_owner: ClassVar[str] = "the engine's"

    def __init__(self, *, device: torch.device, options: TransportOptions,
                 plan: RefitPlan | None = None) -> None:
        self._device = torch.device(device)
        self._options = options
        self._plan = plan
        self._connected = False
        self._updating = False
        self._failed = False
        self._weight_version: int | None = None
        self.last_telemetry: RefitTelemetry | None = None

    @property
    def weight_version(self) -> int | None:
        """Version passed to the last successful :meth:`finish_weight_update`."""
        return self._weight_version

    @property
    @abstractmethod
    def plan(self) -> RefitPlan | None:
        """The plan in use (the given one until the trainer sent its own)."""

    def init_weight_transfer_engine(self, init_info: InitInfo | Mapping[str, Any]) -> None:
        """Connect the transport. For ``non_colocated`` this is a collective with the trainer's
        ``prepare()``: call it on every inference rank while the trainer prepares."""
        if self._connected:
            raise RuntimeError("init_weight_transfer_engine was already called")
        if isinstance(init_info, Mapping):
            init_info = init_info_from_dict(init_info)
        self._connect(init_info)
        self._connected = True

    def start_weight_update(self) -> None:
        """Mark the start of an update (the engine should stop serving requests now)."""
        if not self._connected:
            raise RuntimeError("call init_weight_transfer_engine before start_weight_update")
        if self._updating:
            raise RuntimeError("a weight update is already in progress")
        self._begin()
        self._updating, self._failed = True, False

    def update_weights(self, update_info: Mapping[str, Any] | None = None) -> RefitTelemetry:
        """Receive one refit into the engine; blocks until the trainer's refit completed.

        ``update_info`` is reserved for per-update options and must be empty. Raises
        :class:`~mcore_refit.refit.errors.RefitError` when the refit failed on any side (the
        engine then holds partly old weights and keeps its previous version label).
        """
        if not self._updating:
            raise RuntimeError("call start_weight_update before update_weights")
        if update_info:
            raise ValueError(f"unknown update_info key '{sorted(update_info)[0]}'")
        try:
            self.last_telemetry = self._receive()
        except BaseException:
            self._failed = True
            raise
        logger.info("refit %s", json.dumps(self.last_telemetry.as_dict()))
        return self.last_telemetry

    def finish_weight_update(self, weight_version: int) -> None:
        """Label the loaded weights ``weight_version``; refuses after a failed update."""
        if not self._updating:
            raise RuntimeError("finish_weight_update without start_weight_update")
        self._updating = False
        if self._failed:
            raise RefitError(f"the update to weight version {weight_version} failed; "
                             f"{self.weights_owner} weights are partial and keep their previous "
                             "version label")
        self._finish()
        self._weight_version = weight_version

    def close(self) -> None:
        """Disconnect the receiver (the engine keeps running). Idempotent."""
        if self._connected:
            self._disconnect()
            self._connected = False

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- how each call reaches the receiver ---------------------------------------------------

    @abstractmethod
    def _connect(self, init_info: InitInfo) -> None:
        """Connect and prepare the receiver (or raise, leaving nothing connected)."""

    def _begin(self) -> None:
        """The engine's own start of an update (none by default)."""
        return None

    @abstractmethod
    def _receive(self) -> RefitTelemetry:
        """One whole refit into the engine."""

    def _finish(self) -> None:
        """The engine's own end of a successful update (none by default)."""
        return None

    @abstractmethod
    def _disconnect(self) -> None:
        """Close the receiver."""


class WeightTransferEndpoint(EngineEndpoint):
    """Engine-side control surface for refits into ``engine``, in this process. Owns its
    transport: call :meth:`close`."""

    def __init__(self, *, engine: WeightLoader, device: torch.device, options: TransportOptions,
                 plan: RefitPlan | None = None) -> None:
        super().__init__(device=device, options=options, plan=plan)
        self._engine = engine
        self._receiver: RefitReceiver | None = None

    @property
    def plan(self) -> RefitPlan | None:
        return self._receiver.plan if self._receiver is not None else self._plan

    def _connect(self, init_info: InitInfo) -> None:
        self._receiver = init_info.open(device=self._device, options=self._options,
                                        plan=self._plan)

    def _receive(self) -> RefitTelemetry:
        return self._receiver.receive(self._engine)

    def _disconnect(self) -> None:
        self._receiver.close()
        self._receiver = None
