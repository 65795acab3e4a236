"""Refit configuration: where weights go (``mode``), how the plan lays them out (``plan``), and
how the transports behave (``transport``).

The two halves have different lifetimes. :class:`PlanConfig` is a *planning input*: the trainer
resolves it once into a :class:`~mcore_refit.refit.plan.RefitPlan`, whose fingerprint every
receiver checks, so it must be identical on both sides. :class:`TransportOptions` are per-process
switches (timeouts, checksums, where sockets live) that never change the layout. Transports take
the plan and the options, never the whole config.

Slot size (one rule, resolved on the trainer only): a slot holds at most ``plan.slot_bytes``
bytes, or ``plan.slot_fraction`` × the *total* memory of the trainer's device (total, not free:
free memory differs between ranks and moments, and the plan must be identical on both sides),
rounded down to ``plan.alignment_bytes``; with neither set, :data:`DEFAULT_SLOT_BYTES`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

import torch

from mcore_refit.config import ConfigError

DEFAULT_SLOT_BYTES = 1 << 30
RefitMode = Literal["colocated", "non_colocated"]
IpcSharing = Literal["buffers", "weights"]
Fanout = Literal["broadcast", "relay", "direct"]


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """How tensors are laid out in slots (the ``refit.plan`` section)."""

    # Capacity of one slot in bytes; mutually exclusive with slot_fraction.
    slot_bytes: int | None = None
    # Capacity of one slot as a fraction of the trainer device's total memory, in (0, 1].
    slot_fraction: float | None = None
    # Slots filled round-robin, so packing one overlaps the transfer of another (1 = no overlap).
    num_slots: int = 2
    # Every tensor starts at a multiple of this many bytes inside its buffer (power of two, ≥ 16).
    alignment_bytes: int = 256

    def __post_init__(self) -> None:
        if self.slot_bytes is not None and self.slot_fraction is not None:
            raise ConfigError(f"set only one of `slot_bytes` and `slot_fraction`, got "
                              f"{self.slot_bytes} and {self.slot_fraction}")
        _require_int_at_least("num_slots", self.num_slots, 1)
        _require_int_at_least("alignment_bytes", self.alignment_bytes, 16)
        if self.alignment_bytes & (self.alignment_bytes - 1):
            raise ConfigError(f"`alignment_bytes` must be a power of two, got "
                              f"{self.alignment_bytes}")
        if self.slot_bytes is not None:
            _require_int_at_least("slot_bytes", self.slot_bytes, 2 * self.alignment_bytes)
        if self.slot_fraction is not None:
            fraction = self.slot_fraction
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
                    math.isfinite(fraction) and 0.0 < fraction <= 1.0):
                raise ConfigError(f"`slot_fraction` must be in (0, 1], got {fraction!r}")

    def resolve_slot_bytes(self, device: torch.device) -> int:
        """Bytes per slot on ``device`` (see the module docstring), aligned down."""
        if self.slot_bytes is not None:
            size = self.slot_bytes
        elif self.slot_fraction is not None:
            size = int(self.slot_fraction * total_device_memory(device))
        else:
            size = DEFAULT_SLOT_BYTES
        size -= size % self.alignment_bytes
        if size < 2 * self.alignment_bytes:
            raise ConfigError(f"`slot_fraction`={self.slot_fraction} gives {size} bytes per slot "
                              f"on {device}; need at least {2 * self.alignment_bytes}")
        return size


@dataclass(frozen=True, kw_only=True)
class TransportOptions:
    """How the transports behave (the ``refit.transport`` section); never changes the layout."""

    # Bound on every wait inside a refit (a buffer's transfer, an ACK, a status exchange).
    timeout_s: float = 300.0
    # Bound on the wait for the peer to start a refit (the engine may be busy generating).
    start_timeout_s: float = 600.0
    # Per-buffer checksums computed on both sides and compared before loading.
    checksums: bool = False
    # Parent directory of the private (mode 0700) directory holding the colocated socket and, on
    # CPU, the shared-memory files; null means /dev/shm when present, else the temp directory.
    ipc_dir: str | None = None
    # Colocated: what the engine maps. buffers = slots the trainer packs the weights into;
    # weights = the trainer's own tensors, read in place (one copy, no slots; needs one trainer
    # rank per engine and a source of resident tensors, see
    # mcore_refit/refit/transports/colocated/shared_weights.py).
    ipc_sharing: IpcSharing = "buffers"
    # Non-colocated: how a buffer reaches the inference ranks on other devices. broadcast = one
    # collective over the source and all of them; relay = to one of them (in turn), which
    # forwards it to the others, each over its own two-rank link; direct = from the source to
    # each of them at once, each over its own two-rank link (for at least as many sources as
    # inference ranks; mcore_refit/refit/transports/non_colocated/fanout.py).
    fanout: Fanout = "broadcast"
    # Record peak device memory per refit (resets the device's peak-memory counter each refit).
    track_peak_memory: bool = True
    # While waiting on a peer process (an engine's reply, another rank on the control plane),
    # check this often that it still lives: a dead engine, trainer rank or inference rank is an
    # error naming it within this many seconds, not after a timeout. Engine processes exit
    # this long after their trainer died.
    liveness_s: float = 2.0

    def __post_init__(self) -> None:
        _require_positive_seconds("timeout_s", self.timeout_s)
        _require_positive_seconds("start_timeout_s", self.start_timeout_s)
        _require_positive_seconds("liveness_s", self.liveness_s)


@dataclass(frozen=True, kw_only=True)
class RefitConfig:
    """How weights move from the trainer to the inference engine (the ``refit`` section)."""

    # Keys of the flat section before the plan/transport split.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "buffer_bytes": "plan.slot_bytes",
        "buffer_fraction": "plan.slot_fraction",
        "num_buffers": "plan.num_slots",
        "alignment_bytes": "plan.alignment_bytes",
        "timeout_s": "transport.timeout_s",
        "start_timeout_s": "transport.start_timeout_s",
        "checksums": "transport.checksums",
        "ipc_dir": "transport.ipc_dir",
        "track_peak_memory": "transport.track_peak_memory",
    }

    # non_colocated: broadcast over process groups to other GPUs; colocated: ZMQ + CUDA IPC
    # (shared memory on CPU) to an engine process on the same device.
    mode: RefitMode = "non_colocated"
    plan: PlanConfig = field(default_factory=PlanConfig)
    transport: TransportOptions = field(default_factory=TransportOptions)

    def __post_init__(self) -> None:
        if self.mode not in get_args(RefitMode):
            allowed = ", ".join(repr(m) for m in get_args(RefitMode))
            raise ConfigError(f"config key '`mode`' must be one of {allowed}, got {self.mode!r}")


def total_device_memory(device: torch.device) -> int:
    """Total memory of ``device``: the GPU's, or the host's physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _require_int_at_least(key: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"`{key}` must be an integer ≥ {minimum}, got {value!r}")


def _require_positive_seconds(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ConfigError(f"`{key}` must be a positive number of seconds, got {value!r}")
