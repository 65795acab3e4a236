"""The refit plan: which tensor goes into which buffer, at which offset, sent by which rank.

Pure and built once. Terms used throughout the refit engine:

- a *slot* is a persistent byte tensor, allocated once per side; ``slot_bytes`` is its capacity;
- a *buffer* is one slot's worth of packed tensors in one refit (``num_buffers`` per refit);
- a buffer's *source* is the trainer rank that fills and sends it (several ranks send when each
  exports the weights it holds); ``wire_bytes`` are the bytes it moves (header + payload);
- *payload bytes* are the tensors' own bytes (what a refit delivers); *held bytes* the device
  memory one side's slots take.

Layout rules:

- tensors of one source keep their order; a buffer holds tensors of one source only, taking
  tensors until the next one would overflow it; the buffers of different sources are interleaved
  round-robin (sources in order of first appearance), so every source works at once;
- every buffer starts with a :data:`HEADER_BYTES` header (written by the transports), and every
  tensor starts at a multiple of ``alignment_bytes``;
- a tensor that does not fit in an empty buffer travels alone in an *oversized* buffer of its own
  size;
- regular buffers use slots ``0 .. num_slots-1`` round-robin: on their source, counting that
  source's buffers (:attr:`PlannedBuffer.slot`), and on receivers, counting all buffers
  (:attr:`PlannedBuffer.receiver_slot`); oversized buffers use one extra slot, ``num_slots``,
  sized to the largest of them. Device memory held per side is therefore
  ``num_slots × slot_bytes + largest oversized buffer``.

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

from mcore_refit.refit.specs import TensorSpec, spec_from_json, spec_to_json

PLAN_FORMAT_VERSION = 2
# Bytes reserved at the start of every buffer for the transport's header (see buffers.py).
HEADER_BYTES = 64


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor's place: its position in plan order, its buffer and byte offset."""

    spec: TensorSpec
    index: int
    buffer_index: int
    offset_bytes: int


@dataclass(frozen=True)
class PlannedBuffer:
    """One buffer of a refit: the tensors ``[first_tensor, stop_tensor)``, their source rank and
    the slot the buffer uses on its source (``slot``) and on receivers (``receiver_slot``)."""

    index: int
    source: int
    slot: int
    receiver_slot: int
    first_tensor: int
    stop_tensor: int
    # Header + payload rounded up to the alignment: the bytes a transport moves.
    wire_bytes: int
    oversized: bool

    @property
    def num_tensors(self) -> int:
        return self.stop_tensor - self.first_tensor


@dataclass(frozen=True, eq=False)
class RefitPlan:
    """Ordered tensors grouped into buffers. Build with :func:`build_plan`."""

    tensors: tuple[PlannedTensor, ...]
    buffers: tuple[PlannedBuffer, ...]
    slot_bytes: int
    num_slots: int
    alignment_bytes: int
    header_bytes: int

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RefitPlan) and other.fingerprint == self.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    @cached_property
    def fingerprint(self) -> str:
        """Hex SHA-256 of every name, shape, dtype, offset, source and buffer boundary."""
        return hashlib.sha256(_canonical_json(self).encode()).hexdigest()

    @property
    def fingerprint_words(self) -> tuple[int, int]:
        """The fingerprint's first 16 bytes as two signed int64 (for headers and exchanges)."""
        return struct.unpack("<qq", bytes.fromhex(self.fingerprint)[:16])

    @cached_property
    def payload_offset(self) -> int:
        """Offset of the first tensor in every buffer (the header rounded up to the alignment)."""
        return align_up(self.header_bytes, self.alignment_bytes)

    @property
    def num_buffers(self) -> int:
        return len(self.buffers)

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @cached_property
    def payload_bytes(self) -> int:
        """The sum of all tensor sizes: what a refit delivers."""
        return sum(t.spec.num_bytes for t in self.tensors)

    @cached_property
    def largest_tensor_bytes(self) -> int:
        return max(t.spec.num_bytes for t in self.tensors)

    @cached_property
    def oversized_slot_bytes(self) -> int:
        """Size of the extra slot for oversized buffers (0 when the plan has none)."""
        return max((b.wire_bytes for b in self.buffers if b.oversized), default=0)

    @cached_property
    def piecewise_names(self) -> frozenset[str]:
        """Names of the tensors sent in pieces (one from each tensor-parallel rank)."""
        return frozenset(t.spec.name for t in self.tensors if t.spec.region is not None)

    @cached_property
    def slot_per_buffer(self) -> bool:
        """Every buffer has a slot of its own on its source and on the receivers (``num_slots``
        at least the number of buffers, and at most one oversized): no slot is refilled during
        a refit, so what a receiver reads from its slots stays valid until the next refit."""
        receiver = [b.receiver_slot for b in self.buffers]
        source = [(b.source, b.slot) for b in self.buffers]
        return len(set(receiver)) == len(receiver) and len(set(source)) == len(source)

    @property
    def num_held_slots(self) -> int:
        """Slots one side allocates: the regular ones plus one for oversized buffers, if any."""
        return self.num_slots + (1 if self.oversized_slot_bytes else 0)

    def slot_capacity(self, slot: int) -> int:
        assert 0 <= slot < self.num_held_slots, slot
        return self.slot_bytes if slot < self.num_slots else self.oversized_slot_bytes

    @cached_property
    def held_bytes(self) -> int:
        """Device bytes held by one side's slots for this plan."""
        return sum(self.slot_capacity(s) for s in range(self.num_held_slots))

    @cached_property
    def sources(self) -> tuple[int, ...]:
        """The ranks that send buffers, in order of their first buffer."""
        return tuple(dict.fromkeys(b.source for b in self.buffers))

    def buffers_from(self, source: int) -> tuple[PlannedBuffer, ...]:
        """The buffers ``source`` fills, in plan order."""
        return tuple(b for b in self.buffers if b.source == source)

    def tensors_of(self, buffer: PlannedBuffer) -> tuple[PlannedTensor, ...]:
        return self.tensors[buffer.first_tensor:buffer.stop_tensor]

    @cached_property
    def names(self) -> tuple[str, ...]:
        """Every entry's tensor name, in plan order (a tensor sent in pieces appears once per
        piece)."""
        return tuple(t.spec.name for t in self.tensors)

    def buffer_names(self, buffer_index: int) -> tuple[str, ...]:
        """The labels of the buffer's entries (names, with the place of pieces)."""
        buffer = self.buffers[buffer_index]
        return tuple(t.spec.label for t in self.tensors[buffer.first_tensor:buffer.stop_tensor])

    def specs(self) -> list[TensorSpec]:
        return [t.spec for t in self.tensors]

    def tensor_sources(self) -> list[int]:
        """The source rank of every tensor, in plan order."""
        return [self.buffers[t.buffer_index].source for t in self.tensors]

    def to_json(self) -> str:
        """Plain-data form for the wire; :func:`plan_from_json` rebuilds and re-checks it."""
        return json.dumps({
            "version": PLAN_FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "slot_bytes": self.slot_bytes,
            "num_slots": self.num_slots,
            "alignment_bytes": self.alignment_bytes,
            "header_bytes": self.header_bytes,
            "specs": [spec_to_json(t.spec) for t in self.tensors],
            "sources": self.tensor_sources(),
        }, separators=(",", ":"))


def build_plan(specs: Sequence[TensorSpec], *, slot_bytes: int, num_slots: int,
               alignment_bytes: int = 256, header_bytes: int = HEADER_BYTES,
               sources: Sequence[int] | None = None) -> RefitPlan:
    """Lay ``specs`` out in buffers of at most ``slot_bytes`` (see the module docstring).

    ``sources[i]`` is the rank that produces ``specs[i]`` (default: rank 0 for all).
    """
    _check_layout_args(slot_bytes=slot_bytes, num_slots=num_slots,
                       alignment_bytes=alignment_bytes, header_bytes=header_bytes)
    _check_specs(specs)
    if sources is None:
        sources = [0] * len(specs)
    if len(sources) != len(specs):
        raise ValueError(f"{len(sources)} sources for {len(specs)} tensors")
    by_source: dict[int, list[TensorSpec]] = {}
    for spec, source in zip(specs, sources, strict=True):
        by_source.setdefault(int(source), []).append(spec)
    start = align_up(header_bytes, alignment_bytes)
    chunks = {source: _layout(own, slot_bytes=slot_bytes, start=start,
                              alignment_bytes=alignment_bytes)
              for source, own in by_source.items()}

    tensors: list[PlannedTensor] = []
    buffers: list[PlannedBuffer] = []
    regular_on_source = dict.fromkeys(chunks, 0)
    regular_on_receivers = 0
    for source, chunk in _round_robin(chunks):
        placed, wire_bytes, oversized = chunk
        if oversized:
            slot = receiver_slot = num_slots
        else:
            slot = regular_on_source[source] % num_slots
            receiver_slot = regular_on_receivers % num_slots
            regular_on_source[source] += 1
            regular_on_receivers += 1
        first = len(tensors)
        for spec, offset in placed:
            tensors.append(PlannedTensor(spec=spec, index=len(tensors),
                                         buffer_index=len(buffers), offset_bytes=offset))
        buffers.append(PlannedBuffer(
            index=len(buffers), source=source, slot=slot, receiver_slot=receiver_slot,
            first_tensor=first, stop_tensor=len(tensors), wire_bytes=wire_bytes,
            oversized=oversized))
    return RefitPlan(tensors=tuple(tensors), buffers=tuple(buffers), slot_bytes=slot_bytes,
                     num_slots=num_slots, alignment_bytes=alignment_bytes,
                     header_bytes=header_bytes)


def plan_from_json(text: str) -> RefitPlan:
    """Rebuild a plan from :meth:`RefitPlan.to_json`; raises ``ValueError`` on any mismatch."""
    try:
        data = json.loads(text)
        version = data["version"]
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"plan format version {version}, expected {PLAN_FORMAT_VERSION}")
        specs = [spec_from_json(spec) for spec in data["specs"]]
        plan = build_plan(specs, slot_bytes=int(data["slot_bytes"]),
                          num_slots=int(data["num_slots"]),
                          alignment_bytes=int(data["alignment_bytes"]),
                          header_bytes=int(data["header_bytes"]),
                          sources=[int(s) for s in data["sources"]])
    except (KeyError, TypeError, json.JSONDecodeError) as error:
        raise ValueError(f"malformed refit plan: {error!r}") from None
    if plan.fingerprint != data["fingerprint"]:
        raise ValueError(
            f"refit plan fingerprint {data['fingerprint']} does not match its content "
            f"({plan.fingerprint}); sender and receiver disagree on the layout rules"
        )
    return plan


# One source's buffers before interleaving: [(spec, offset)], wire bytes, oversized.
_Chunk = tuple[list[tuple[TensorSpec, int]], int, bool]


def _layout(specs: Sequence[TensorSpec], *, slot_bytes: int, start: int,
            alignment_bytes: int) -> list[_Chunk]:
    """One source's tensors in buffers, in order (see the module docstring)."""
    chunks: list[_Chunk] = []
    placed: list[tuple[TensorSpec, int]] = []
    cursor = start

    def close(*, oversized: bool) -> None:
        nonlocal placed, cursor
        chunks.append((placed, align_up(cursor, alignment_bytes), oversized))
        placed, cursor = [], start

    for spec in specs:
        nbytes = spec.num_bytes
        if start + nbytes > slot_bytes:
            if placed:
                close(oversized=False)
            placed.append((spec, start))
            cursor = start + nbytes
            close(oversized=True)
            continue
        offset = align_up(cursor, alignment_bytes)
        if offset + nbytes > slot_bytes:
            close(oversized=False)
            offset = start
        placed.append((spec, offset))
        cursor = offset + nbytes
    if placed:
        close(oversized=False)
    return chunks


def _round_robin(chunks: dict[int, list[_Chunk]]):
    """``(source, chunk)`` taking one chunk of each source in turn until all are used."""
    iterators = {source: iter(own) for source, own in chunks.items()}
    while iterators:
        for source in list(iterators):
            chunk = next(iterators[source], None)
            if chunk is None:
                del iterators[source]
            else:
                yield source, chunk


def _canonical_json(plan: RefitPlan) -> str:
    return json.dumps({
        "version": PLAN_FORMAT_VERSION,
        "slot_bytes": plan.slot_bytes,
        "num_slots": plan.num_slots,
        "alignment_bytes": plan.alignment_bytes,
        "header_bytes": plan.header_bytes,
        "tensors": [[*spec_to_json(t.spec), t.buffer_index, t.offset_bytes] for t in plan.tensors],
        "buffers": [[b.source, b.slot, b.receiver_slot, b.first_tensor, b.stop_tensor,
                     b.wire_bytes, b.oversized] for b in plan.buffers],
    }, separators=(",", ":"))


def _check_layout_args(*, slot_bytes: int, num_slots: int, alignment_bytes: int,
                       header_bytes: int) -> None:
    if alignment_bytes < 16 or alignment_bytes & (alignment_bytes - 1):
        raise ValueError(f"alignment_bytes must be a power of two ≥ 16, got {alignment_bytes}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be ≥ 1, got {num_slots}")
    if header_bytes < 0 or header_bytes % 8:
        raise ValueError(f"header_bytes must be a non-negative multiple of 8, got {header_bytes}")
    if slot_bytes % alignment_bytes or slot_bytes <= align_up(header_bytes, alignment_bytes):
        raise ValueError(
            f"slot_bytes={slot_bytes} must be a multiple of alignment_bytes={alignment_bytes} "
            f"and larger than the {header_bytes}-byte header"
        )


def _check_specs(specs: Sequence[TensorSpec]) -> None:
    """Every tensor once: a whole tensor, or pieces that cover it exactly once."""
    if not specs:
        raise ValueError("a refit plan needs at least one tensor; the weight source is empty")
    pieces: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        if any(d < 0 for d in spec.shape):
            raise ValueError(f"tensor {spec.label!r} has a negative dimension: {spec.shape}")
        pieces.setdefault(spec.name, []).append(spec)
    for name, parts in pieces.items():
        if len(parts) == 1 and parts[0].region is None:
            continue
        if any(p.region is None for p in parts):
            raise ValueError(f"tensor name {name!r} appears twice in the weight source")
        dims = {(p.region.dim, p.region.full) for p in parts}
        if len(dims) != 1:
            raise ValueError(f"the pieces of {name!r} disagree on their dimension and size")
        dim, full = dims.pop()
        covered = sorted((p.region.start, p.region.start + p.shape[dim]) for p in parts)
        cursor = 0
        for start, stop in covered:
            if start != cursor:
                raise ValueError(f"the pieces of {name!r} overlap or leave a gap at {cursor} "
                                 f"along dim {dim}")
            cursor = stop
        if cursor != full:
            raise ValueError(f"the pieces of {name!r} cover {cursor} of its {full} along dim "
                             f"{dim}")


def align_up(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment``."""
    return (value + alignment - 1) // alignment * alignment
