"""Per-refit measurements: time per phase, bytes, bandwidth, device memory.

Phases overlap by design (export and pack of one buffer run while another is on the wire), so
they do not add up to ``total_s``. Meanings:

- ``export_s``: host time spent inside the weight source's iterator;
- ``pack_s``: time copying tensors into buffers (device time on GPU, host time on CPU);
- ``transfer_s``: the transfer window, from the first buffer leaving to the last one arriving
  (device time on GPU; host time on CPU; for the colocated transport, the time spent waiting for
  the engine's ACKs);
- ``load_s``: receiver only, time in the engine's ``load_weights`` (device time on GPU);
- ``wait_s``: host time blocked on a buffer slot, an arrival or an ACK;
- ``checksum_s`` / ``verify_s``: time in per-buffer checksums / the post-refit equality check;
- ``engine``: receiver only, the engine's own figures of the refit where it has them (vLLM:
  ``load_s``, seconds in its loader; ``setup_s`` / ``finalize_s``, those of the reload's set-up
  and finalisation; ``load_calls``, calls into it; ``wait_s``, seconds the last buffer waited
  for its loads);
- ``payload_bytes``: the tensors' own bytes the refit delivered;
- ``held_bytes``: device memory this rank holds for refits (its slots, mapped peer slots not
  counted; the export's shard exchange buffers where it has them);
- ``peak_extra_bytes``: ``held_bytes`` plus the peak of device memory allocated above the level
  at refit start (``None`` on CPU);
- ``new_allocations`` / ``new_segments``: caching-allocator allocations / cudaMalloc segments
  made during the refit (``None`` on CPU). A steady-state refit from resident tensors makes 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from mcore_refit.refit.plan import RefitPlan


@dataclass(kw_only=True)
class RefitTelemetry:
    """Measurements of one refit on one rank; :meth:`as_dict` gives the loggable form."""

    role: str
    transport: str
    refit_index: int
    device: str
    num_tensors: int
    num_buffers: int
    payload_bytes: int
    total_s: float = 0.0
    export_s: float = 0.0
    pack_s: float = 0.0
    transfer_s: float = 0.0
    load_s: float = 0.0
    wait_s: float = 0.0
    checksum_s: float = 0.0
    verify_s: float = 0.0
    held_bytes: int = 0
    peak_transient_bytes: int | None = None
    new_allocations: int | None = None
    new_segments: int | None = None
    checksums: bool = False
    verified: bool | None = None
    engine: dict[str, float] = field(default_factory=dict)

    @classmethod
    def for_plan(cls, plan: RefitPlan, *, role: str, transport: str, refit_index: int,
                 device: torch.device, held_bytes: int, checksums: bool = False,
                 num_buffers: int | None = None) -> RefitTelemetry:
        """A refit's telemetry before it starts: the plan's sizes and this rank's place."""
        return cls(role=role, transport=transport, refit_index=refit_index, device=str(device),
                   num_tensors=plan.num_tensors, payload_bytes=plan.payload_bytes,
                   num_buffers=plan.num_buffers if num_buffers is None else num_buffers,
                   held_bytes=held_bytes, checksums=checksums)

    @property
    def gbps(self) -> float:
        """Payload gigabytes (1e9) per second over the whole refit."""
        return self.payload_bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    @property
    def peak_extra_bytes(self) -> int | None:
        if self.peak_transient_bytes is None:
            return None
        return self.held_bytes + self.peak_transient_bytes

    def record_memory(self, stats: dict[str, int | None]) -> None:
        """Take ``peak_transient_bytes``, ``new_allocations``, ``new_segments`` from a probe."""
        self.peak_transient_bytes = stats["peak_transient_bytes"]
        self.new_allocations = stats["new_allocations"]
        self.new_segments = stats["new_segments"]

    def as_dict(self) -> dict[str, object]:
        data = dataclasses.asdict(self)
        data["gbps"] = round(self.gbps, 3)
        data["peak_extra_bytes"] = self.peak_extra_bytes
        for key, value in data.items():
            if key.endswith("_s") and isinstance(value, float):
                data[key] = round(value, 6)
        return data
