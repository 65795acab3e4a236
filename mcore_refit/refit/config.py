"""Refit configuration: buffer sizing, transport mode, timeouts and verification switches.

Buffer size semantics (one rule, resolved on the trainer only): each of the ``num_buffers``
buffers holds at most ``buffer_bytes`` bytes, or ``buffer_fraction`` × the *total* memory of the
trainer's device (total, not free: free memory differs between ranks and moments, and the plan
must be identical on both sides). The size is rounded down to ``alignment_bytes``. With neither
key set a buffer is :data:`DEFAULT_BUFFER_BYTES`. The receiver never resolves a size of its own:
it takes the plan from the trainer (or checks its own against the trainer's fingerprint).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

import torch

DEFAULT_BUFFER_BYTES = 1 << 30
RefitMode = Literal["colocated", "non_colocated"]


@dataclass(frozen=True, kw_only=True)
class RefitConfig:
    """How weights move from the trainer to the inference engine (the ``refit`` section)."""

    # non_colocated: broadcast over a process group to other GPUs; colocated: ZMQ + CUDA IPC
    # (shared memory on CPU) to an engine process on the same device.
    mode: RefitMode = "non_colocated"
    # Capacity of one buffer in bytes; mutually exclusive with buffer_fraction.
    buffer_bytes: int | None = None
    # Capacity of one buffer as a fraction of the trainer device's total memory, in (0, 1].
    buffer_fraction: float | None = None
    # Buffers filled round-robin so packing one overlaps the transfer of another (1 = no overlap).
    num_buffers: int = 2
    # Every tensor starts at a multiple of this many bytes inside its buffer (power of two, ≥ 16).
    alignment_bytes: int = 256
    # Bound on every wait inside a refit (a buffer's transfer, an ACK, a status exchange).
    timeout_s: float = 300.0
    # Bound on the wait for the peer to start a refit (the engine may be busy generating).
    start_timeout_s: float = 600.0
    # Per-buffer checksums computed on both sides and compared before loading.
    checksums: bool = False
    # Parent directory of the private (mode 0700) directory holding the colocated socket and, on
    # CPU, the shared-memory files; null means /dev/shm when present, else the temp directory.
    ipc_dir: str | None = None
    # Record peak device memory per refit (resets the device's peak-memory counter each refit).
    track_peak_memory: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("colocated", "non_colocated"):
            raise ValueError(
                f"refit.mode must be 'colocated' or 'non_colocated', got {self.mode!r}"
            )
        if self.buffer_bytes is not None and self.buffer_fraction is not None:
            raise ValueError(
                "set only one of refit.buffer_bytes and refit.buffer_fraction, "
                f"got {self.buffer_bytes} and {self.buffer_fraction}"
            )
        _require_int_at_least("refit.num_buffers", self.num_buffers, 1)
        _require_int_at_least("refit.alignment_bytes", self.alignment_bytes, 16)
        if self.alignment_bytes & (self.alignment_bytes - 1):
            raise ValueError(
                f"refit.alignment_bytes must be a power of two, got {self.alignment_bytes}"
            )
        if self.buffer_bytes is not None:
            _require_int_at_least("refit.buffer_bytes", self.buffer_bytes,
                                  2 * self.alignment_bytes)
        if self.buffer_fraction is not None:
            fraction = self.buffer_fraction
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
                math.isfinite(fraction) and 0.0 < fraction <= 1.0
            ):
                raise ValueError(f"refit.buffer_fraction must be in (0, 1], got {fraction!r}")
        _require_positive_seconds("refit.timeout_s", self.timeout_s)
        _require_positive_seconds("refit.start_timeout_s", self.start_timeout_s)

    def resolve_buffer_bytes(self, device: torch.device) -> int:
        """Bytes per buffer on ``device`` (see the module docstring), aligned down."""
        if self.buffer_bytes is not None:
            size = self.buffer_bytes
        elif self.buffer_fraction is not None:
            size = int(self.buffer_fraction * total_device_memory(device))
        else:
            size = DEFAULT_BUFFER_BYTES
        size -= size % self.alignment_bytes
        if size < 2 * self.alignment_bytes:
            raise ValueError(
                f"refit.buffer_fraction={self.buffer_fraction} gives {size} bytes per buffer on "
                f"{device}; need at least {2 * self.alignment_bytes}"
            )
        return size


def total_device_memory(device: torch.device) -> int:
    """Total memory of ``device``: the GPU's, or the host's physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _require_int_at_least(key: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer ≥ {minimum}, got {value!r}")


def _require_positive_seconds(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value > 0
    ):
        raise ValueError(f"{key} must be a positive number of seconds, got {value!r}")
