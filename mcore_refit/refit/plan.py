"""The refit plan: which tensor goes into which buffer at which offset. Pure, built once.

Layout rules:

- tensors keep the source's order; a buffer takes tensors until the next one would overflow it;
- every buffer starts with a :data:`HEADER_BYTES` header (written by the transports), and every
  tensor starts at a multiple of ``alignment_bytes``;
- a tensor that does not fit in an empty buffer travels alone in an *oversized* buffer of its own
  size;
- regular buffers use slots ``0 .. num_slots-1`` round-robin; every oversized buffer uses one
  extra slot, ``num_slots``, sized to the largest of them. Device memory held by the buffers is
  therefore ``num_slots × buffer_bytes + largest oversized buffer``.

The fingerprint hashes all of the above; both ends of a transport compare fingerprints at the
start of every refit.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from mcore_refit.refit.source import TensorSpec

PLAN_FORMAT_VERSION = 1
# Bytes reserved at the start of every buffer for the transport's header (see buffers.py).
HEADER_BYTES = 64


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor's place: its position in the source order, its buffer and byte offset."""

    spec: TensorSpec
    index: int
    buffer_index: int
    offset_bytes: int


@dataclass(frozen=True)
class PlannedBuffer:
    """One buffer of a refit: the tensors ``[first_tensor, stop_tensor)`` and the slot it uses."""

    index: int
    slot: int
    first_tensor: int
    stop_tensor: int
    # Header + payload rounded up to the alignment: the bytes a transport moves.
    used_bytes: int
    oversized: bool

    @property
    def num_tensors(self) -> int:
        return self.stop_tensor - self.first_tensor


@dataclass(frozen=True, eq=False)
class RefitPlan:
    """Ordered tensors grouped into buffers. Build with :func:`build_plan`."""

    tensors: tuple[PlannedTensor, ...]
    buffers: tuple[PlannedBuffer, ...]
    buffer_bytes: int
    num_slots: int
    alignment_bytes: int
    header_bytes: int

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RefitPlan) and other.fingerprint == self.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    @cached_property
    def fingerprint(self) -> str:
        """Hex SHA-256 of every name, shape, dtype, offset and buffer boundary of the plan."""
        return hashlib.sha256(_canonical_json(self).encode()).hexdigest()

    @property
    def fingerprint_words(self) -> tuple[int, int]:
        """The fingerprint's first 16 bytes as two signed int64 (for collective exchanges)."""
        return struct.unpack("<qq", bytes.fromhex(self.fingerprint)[:16])

    @cached_property
    def payload_offset(self) -> int:
        """Offset of the first tensor in every buffer (the header rounded up to the alignment)."""
        return _align_up(self.header_bytes, self.alignment_bytes)

    @property
    def num_buffers(self) -> int:
        return len(self.buffers)

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @cached_property
    def total_bytes(self) -> int:
        """Payload bytes: the sum of all tensor sizes (what a refit delivers)."""
        return sum(t.spec.num_bytes for t in self.tensors)

    @cached_property
    def largest_tensor_bytes(self) -> int:
        return max(t.spec.num_bytes for t in self.tensors)

    @cached_property
    def oversized_slot_bytes(self) -> int:
        """Size of the extra slot for oversized buffers (0 when the plan has none)."""
        return max((b.used_bytes for b in self.buffers if b.oversized), default=0)

    @property
    def num_slots_total(self) -> int:
        """Slots to allocate: the regular ones plus one for oversized buffers, if any."""
        return self.num_slots + (1 if self.oversized_slot_bytes else 0)

    def slot_bytes(self, slot: int) -> int:
        assert 0 <= slot < self.num_slots_total, slot
        return self.buffer_bytes if slot < self.num_slots else self.oversized_slot_bytes

    @cached_property
    def held_bytes(self) -> int:
        """Device bytes held by one side's buffers for this plan."""
        return sum(self.slot_bytes(s) for s in range(self.num_slots_total))

    def tensors_of(self, buffer: PlannedBuffer) -> tuple[PlannedTensor, ...]:
        return self.tensors[buffer.first_tensor:buffer.stop_tensor]

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(t.spec.name for t in self.tensors)

    def buffer_names(self, buffer_index: int) -> tuple[str, ...]:
        buffer = self.buffers[buffer_index]
        return self.names[buffer.first_tensor:buffer.stop_tensor]

    def specs(self) -> list[TensorSpec]:
        return [t.spec for t in self.tensors]

    def to_json(self) -> str:
        """Plain-data form for the wire; :func:`plan_from_json` rebuilds and re-checks it."""
        return json.dumps({
            "version": PLAN_FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "buffer_bytes": self.buffer_bytes,
            "num_slots": self.num_slots,
            "alignment_bytes": self.alignment_bytes,
            "header_bytes": self.header_bytes,
            "specs": [[t.spec.name, list(t.spec.shape), dtype_name(t.spec.dtype)]
                      for t in self.tensors],
        }, separators=(",", ":"))


def build_plan(specs: Sequence[TensorSpec], *, buffer_bytes: int, num_slots: int,
               alignment_bytes: int = 256, header_bytes: int = HEADER_BYTES) -> RefitPlan:
    """Lay ``specs`` out in buffers of at most ``buffer_bytes`` (see the module docstring)."""
    _check_layout_args(buffer_bytes=buffer_bytes, num_slots=num_slots,
                       alignment_bytes=alignment_bytes, header_bytes=header_bytes)
    _check_specs(specs)
    start = _align_up(header_bytes, alignment_bytes)
    tensors: list[PlannedTensor] = []
    buffers: list[PlannedBuffer] = []
    num_regular = 0
    first = 0
    cursor = start

    def close(*, oversized: bool) -> None:
        nonlocal first, cursor, num_regular
        slot = num_slots if oversized else num_regular % num_slots
        num_regular += 0 if oversized else 1
        buffers.append(PlannedBuffer(
            index=len(buffers), slot=slot, first_tensor=first, stop_tensor=len(tensors),
            used_bytes=_align_up(cursor, alignment_bytes), oversized=oversized,
        ))
        first, cursor = len(tensors), start

    for spec in specs:
        nbytes = spec.num_bytes
        if start + nbytes > buffer_bytes:
            if len(tensors) > first:
                close(oversized=False)
            tensors.append(PlannedTensor(spec=spec, index=len(tensors),
                                         buffer_index=len(buffers), offset_bytes=start))
            cursor = start + nbytes
            close(oversized=True)
            continue
        offset = _align_up(cursor, alignment_bytes)
        if offset + nbytes > buffer_bytes:
            close(oversized=False)
            offset = start
        tensors.append(PlannedTensor(spec=spec, index=len(tensors), buffer_index=len(buffers),
                                     offset_bytes=offset))
        cursor = offset + nbytes
    if len(tensors) > first:
        close(oversized=False)
    return RefitPlan(tensors=tuple(tensors), buffers=tuple(buffers), buffer_bytes=buffer_bytes,
                     num_slots=num_slots, alignment_bytes=alignment_bytes,
                     header_bytes=header_bytes)


def plan_from_json(text: str) -> RefitPlan:
    """Rebuild a plan from :meth:`RefitPlan.to_json`; raises ``ValueError`` on any mismatch."""
    try:
        data = json.loads(text)
        version = data["version"]
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"plan format version {version}, expected {PLAN_FORMAT_VERSION}")
        specs = [TensorSpec(name=name, shape=tuple(int(d) for d in shape),
                            dtype=dtype_from_name(dtype))
                 for name, shape, dtype in data["specs"]]
        plan = build_plan(specs, buffer_bytes=int(data["buffer_bytes"]),
                          num_slots=int(data["num_slots"]),
                          alignment_bytes=int(data["alignment_bytes"]),
                          header_bytes=int(data["header_bytes"]))
    except (KeyError, TypeError, json.JSONDecodeError) as error:
        raise ValueError(f"malformed refit plan: {error!r}") from None
    if plan.fingerprint != data["fingerprint"]:
        raise ValueError(
            f"refit plan fingerprint {data['fingerprint']} does not match its content "
            f"({plan.fingerprint}); sender and receiver disagree on the layout rules"
        )
    return plan


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def _canonical_json(plan: RefitPlan) -> str:
    return json.dumps({
        "version": PLAN_FORMAT_VERSION,
        "buffer_bytes": plan.buffer_bytes,
        "num_slots": plan.num_slots,
        "alignment_bytes": plan.alignment_bytes,
        "header_bytes": plan.header_bytes,
        "tensors": [[t.spec.name, list(t.spec.shape), dtype_name(t.spec.dtype), t.buffer_index,
                     t.offset_bytes] for t in plan.tensors],
        "buffers": [[b.slot, b.first_tensor, b.stop_tensor, b.used_bytes, b.oversized]
                    for b in plan.buffers],
    }, separators=(",", ":"))


def _check_layout_args(*, buffer_bytes: int, num_slots: int, alignment_bytes: int,
                       header_bytes: int) -> None:
    if alignment_bytes < 16 or alignment_bytes & (alignment_bytes - 1):
        raise ValueError(f"alignment_bytes must be a power of two ≥ 16, got {alignment_bytes}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be ≥ 1, got {num_slots}")
    if header_bytes < 0 or header_bytes % 8:
        raise ValueError(f"header_bytes must be a non-negative multiple of 8, got {header_bytes}")
    if buffer_bytes % alignment_bytes or buffer_bytes <= _align_up(header_bytes, alignment_bytes):
        raise ValueError(
            f"buffer_bytes={buffer_bytes} must be a multiple of alignment_bytes={alignment_bytes} "
            f"and larger than the {header_bytes}-byte header"
        )


def _check_specs(specs: Sequence[TensorSpec]) -> None:
    if not specs:
        raise ValueError("a refit plan needs at least one tensor; the weight source is empty")
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"tensor name {spec.name!r} appears twice in the weight source")
        seen.add(spec.name)
        if any(d < 0 for d in spec.shape):
            raise ValueError(f"tensor {spec.name!r} has a negative dimension: {spec.shape}")


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment
