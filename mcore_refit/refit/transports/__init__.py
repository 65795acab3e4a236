"""The ways refit bytes move, by name: a registry of transports and the factory over it.

Each transport is a sender class (trainer end) and a receiver class (engine end), named by
``"module.path:ClassName"`` and imported only when chosen, so a transport's dependencies (ZMQ,
an inference engine's own package) load only where it is used. The built-in transports are
named after the placement they serve (``refit.mode``):

- ``colocated``: the engine process shares the trainer's device; buffers are slots the trainer
  packs and the engine maps (:mod:`.colocated`; ``refit.transport.ipc_sharing: buffers``);
- ``colocated_weights``: the same, but the engine maps the trainer's own tensors, no slots
  (``ipc_sharing: weights``);
- ``non_colocated``: inference ranks on other devices receive each buffer by broadcast from its
  source trainer rank, those on a source's own device by IPC hand-over (:mod:`.non_colocated`).

Another backend registers itself with :func:`register_transport` and is chosen by its name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcore_refit.refit.config import TransportOptions
    from mcore_refit.refit.transports.base import RefitReceiver, RefitSender


@dataclass(frozen=True)
class TransportEntry:
    """Where a transport's two ends live, as ``"module.path:ClassName"``."""

    sender: str
    receiver: str


_PACKAGE = "mcore_refit.refit.transports"
_TRANSPORTS: dict[str, TransportEntry] = {
    "colocated": TransportEntry(sender=f"{_PACKAGE}.colocated.sender:ColocatedSender",
                                receiver=f"{_PACKAGE}.colocated.receiver:ColocatedReceiver"),
    "colocated_weights": TransportEntry(
        sender=f"{_PACKAGE}.colocated.shared_weights:SharedWeightsSender",
        receiver=f"{_PACKAGE}.colocated.receiver:ColocatedReceiver"),
    "non_colocated": TransportEntry(
        sender=f"{_PACKAGE}.non_colocated.sender:NonColocatedSender",
        receiver=f"{_PACKAGE}.non_colocated.receiver:NonColocatedReceiver"),
}


def register_transport(name: str, *, sender: str, receiver: str) -> None:
    """Add transport ``name``: its sender and receiver classes as ``"module.path:ClassName"``.

    Raises ``ValueError`` if the name is taken (a transport is never replaced silently).
    """
    if name in _TRANSPORTS:
        raise ValueError(f"refit transport {name!r} is already registered "
                         f"(sender {_TRANSPORTS[name].sender})")
    for end, path in (("sender", sender), ("receiver", receiver)):
        if path.count(":") != 1:
            raise ValueError(f"the {end} of transport {name!r} must be 'module.path:ClassName', "
                             f"got {path!r}")
    _TRANSPORTS[name] = TransportEntry(sender=sender, receiver=receiver)


def transport_names() -> list[str]:
    """Every registered transport, sorted."""
    return sorted(_TRANSPORTS)


def transport_for(mode: str, options: TransportOptions) -> str:
    """The built-in transport for a placement: ``refit.mode`` and, when colocated,
    ``refit.transport.ipc_sharing``."""
    if mode == "colocated":
        return "colocated_weights" if options.ipc_sharing == "weights" else "colocated"
    if mode == "non_colocated":
        return "non_colocated"
    raise ValueError(f"unknown refit mode {mode!r}; expected 'colocated' or 'non_colocated'")


def sender_class(name: str) -> type[RefitSender]:
    """The trainer end of transport ``name`` (imported now)."""
    return _load(name, "sender")


def receiver_class(name: str) -> type[RefitReceiver]:
    """The engine end of transport ``name`` (imported now)."""
    return _load(name, "receiver")


def create_sender(name: str, **kwargs: Any) -> RefitSender:
    """A sender of transport ``name``, built with its class's own keyword arguments."""
    return sender_class(name)(**kwargs)


def create_receiver(name: str, **kwargs: Any) -> RefitReceiver:
    """A receiver of transport ``name``, built with its class's own keyword arguments."""
    return receiver_class(name)(**kwargs)


def _load(name: str, end: str) -> type:
    entry = _TRANSPORTS.get(name)
    if entry is None:
        raise ValueError(f"unknown refit transport {name!r}; choose one of "
                         f"{', '.join(repr(n) for n in transport_names())}")
    module_name, class_name = getattr(entry, end).split(":")
    return getattr(importlib.import_module(module_name), class_name)
