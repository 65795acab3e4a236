"""Persistent packed byte buffers (the output buffer cache) and packing/unpacking into them.

:class:`BufferSlots` owns one flat ``uint8`` tensor per plan slot, allocated once (or mapped from
another process) and reused on every refit. For every buffer of the plan it precomputes, once,
the typed views where that buffer's tensors live inside its slot; packing is then one
``torch._foreach_copy_`` per dtype and unpacking returns those views (zero-copy).

Every buffer starts with a :data:`~mcore_refit.refit.plan.HEADER_BYTES` header of int64 words
(:class:`BufferHeader`), written by the sender and checked by the receiver before loading: it
catches a receiver reading the wrong refit or buffer, and carries the sender's abort flag and
checksum in-band.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mcore_refit.refit.checksum import buffer_checksum
from mcore_refit.refit.errors import RefitError
from mcore_refit.refit.plan import HEADER_BYTES, RefitPlan, align_up
from mcore_refit.refit.source import Piecewise, SourceReader
from mcore_refit.refit.specs import TensorSpec
from mcore_refit.refit.streams import DeviceStreams

# "MCREFIT1" as a little-endian int64.
HEADER_MAGIC = int.from_bytes(b"MCREFIT1", "little")
HEADER_WORDS = HEADER_BYTES // 8


class BufferStatus(enum.IntEnum):
    OK = 0
    # The sender failed before packing this buffer; its bytes are stale and must not be loaded.
    ABORTED = 1


class HeaderWord(enum.IntEnum):
    """The int64 words of a buffer header, by position."""

    MAGIC = 0
    REFIT_INDEX = 1
    BUFFER_INDEX = 2
    STATUS = 3
    WIRE_BYTES = 4
    CHECKSUM = 5
    HAS_CHECKSUM = 6
    FINGERPRINT = 7


@dataclass(frozen=True, kw_only=True)
class BufferHeader:
    """The header at the start of every buffer."""

    refit_index: int
    buffer_index: int
    status: BufferStatus
    wire_bytes: int
    fingerprint_word: int
    checksum: int | None = None

    def to_words(self) -> list[int]:
        words = [0] * HEADER_WORDS
        words[HeaderWord.MAGIC] = HEADER_MAGIC
        words[HeaderWord.REFIT_INDEX] = self.refit_index
        words[HeaderWord.BUFFER_INDEX] = self.buffer_index
        words[HeaderWord.STATUS] = int(self.status)
        words[HeaderWord.WIRE_BYTES] = self.wire_bytes
        words[HeaderWord.CHECKSUM] = self.checksum if self.checksum is not None else 0
        words[HeaderWord.HAS_CHECKSUM] = int(self.checksum is not None)
        words[HeaderWord.FINGERPRINT] = self.fingerprint_word
        return words

    @classmethod
    def from_words(cls, words: Sequence[int]) -> BufferHeader:
        if len(words) != HEADER_WORDS or words[HeaderWord.MAGIC] != HEADER_MAGIC:
            raise ValueError("buffer header has no valid magic word: the buffer was not packed "
                             "by a refit sender (or was overwritten)")
        try:
            status = BufferStatus(words[HeaderWord.STATUS])
        except ValueError:
            raise ValueError(
                f"buffer header has unknown status {words[HeaderWord.STATUS]}") from None
        return cls(
            refit_index=words[HeaderWord.REFIT_INDEX],
            buffer_index=words[HeaderWord.BUFFER_INDEX],
            status=status, wire_bytes=words[HeaderWord.WIRE_BYTES],
            fingerprint_word=words[HeaderWord.FINGERPRINT],
            checksum=words[HeaderWord.CHECKSUM] if words[HeaderWord.HAS_CHECKSUM] else None,
        )

    def check_expected(self, *, plan: RefitPlan, refit_index: int, buffer_index: int) -> None:
        """Raise ``ValueError`` unless this is the header of ``buffer_index`` of ``refit_index``."""
        expected = (refit_index, buffer_index, plan.buffers[buffer_index].wire_bytes,
                    plan.fingerprint_words[0])
        found = (self.refit_index, self.buffer_index, self.wire_bytes, self.fingerprint_word)
        if found != expected:
            raise ValueError(
                "buffer header (refit, buffer, wire bytes, plan word) = "
                f"{found}, expected {expected}: sender and receiver are out of step"
            )


def check_buffer(header_words: Sequence[int], *, plan: RefitPlan, buffer_index: int,
                 refit_index: int, checksum: int | None) -> None:
    """Raise :class:`RefitError` unless the received ``header_words`` say buffer ``buffer_index``
    of ``refit_index`` arrived whole and may be loaded; ``checksum`` is the payload's sum as
    received (None: checksums off)."""
    try:
        header = BufferHeader.from_words(header_words)
        if header.status == BufferStatus.ABORTED:
            raise RefitError(f"buffer {buffer_index}: its source aborted the refit")
        header.check_expected(plan=plan, refit_index=refit_index, buffer_index=buffer_index)
    except ValueError as error:
        raise RefitError(f"buffer {buffer_index}: {error}") from None
    if checksum is not None and header.checksum != checksum:
        names = plan.buffer_names(buffer_index)
        raise RefitError(f"checksum mismatch in buffer {buffer_index}: sent {header.checksum}, "
                         f"received {checksum} (tensors {names[0]!r} .. {names[-1]!r})")


class BufferSlots:
    """One persistent ``uint8`` tensor per plan slot, plus precomputed views into them.

    A buffer sits in slot ``buffer.slot`` on its source and in ``buffer.receiver_slot`` on ranks
    every buffer passes through (``all_buffers=True``: every trainer rank of a colocated refit,
    and the engine that maps its slots); ``slot_map`` (buffer index → slot) overrides both for a
    receiver that numbers its slots itself. Allocate with :meth:`allocate` (zero-filled, so
    alignment padding is always zero and checksums over whole buffers agree on both sides) or
    wrap tensors mapped from another process.
    """

    def __init__(self, *, plan: RefitPlan, slots: Sequence[torch.Tensor],
                 all_buffers: bool = False, slot_map: Sequence[int] | None = None) -> None:
        if len(slots) != plan.num_held_slots:
            raise ValueError(f"plan needs {plan.num_held_slots} slots, got {len(slots)}")
        for index, slot in enumerate(slots):
            if slot.dtype != torch.uint8 or slot.dim() != 1 or not slot.is_contiguous():
                raise ValueError(f"slot {index} must be a contiguous 1-D uint8 tensor")
            if slot.numel() < plan.slot_capacity(index):
                raise ValueError(
                    f"slot {index} has {slot.numel()} bytes, the plan needs "
                    f"{plan.slot_capacity(index)}"
                )
        self.plan = plan
        self._slot_map = (list(slot_map) if slot_map is not None else
                          [b.receiver_slot if all_buffers else b.slot for b in plan.buffers])
        self.slots: list[torch.Tensor] = list(slots)
        self.device = self.slots[0].device
        self._views: list[list[torch.Tensor] | None] = [None] * plan.num_buffers
        self._entries: list[list[tuple[TensorSpec, torch.Tensor]] | None] = (
            [None] * plan.num_buffers)
        self._groups: list[list[list[int]] | None] = [None] * plan.num_buffers

    @classmethod
    def allocate(cls, plan: RefitPlan, device: torch.device, *, all_buffers: bool = False,
                 slot_map: Sequence[int] | None = None) -> BufferSlots:
        """Allocate the plan's slots on ``device`` (the only allocation a transport makes)."""
        slots = [torch.zeros(plan.slot_capacity(s), dtype=torch.uint8, device=device)
                 for s in range(plan.num_held_slots)]
        return cls(plan=plan, slots=slots, all_buffers=all_buffers, slot_map=slot_map)

    @property
    def held_bytes(self) -> int:
        return sum(slot.numel() for slot in self.slots)

    def slot_index(self, buffer_index: int) -> int:
        return self._slot_map[buffer_index]

    def slot_of(self, buffer_index: int) -> torch.Tensor:
        return self.slots[self.slot_index(buffer_index)]

    def wire_view(self, buffer_index: int) -> torch.Tensor:
        """The bytes a transport moves for this buffer: header and payload."""
        return self.slot_of(buffer_index)[:self.plan.buffers[buffer_index].wire_bytes]

    def header_view(self, buffer_index: int) -> torch.Tensor:
        return self.slot_of(buffer_index)[:HEADER_BYTES].view(torch.int64)

    def checksum_word(self, buffer_index: int) -> torch.Tensor:
        """The header's checksum word (0-dim view), where senders write the payload's sum."""
        return self.header_view(buffer_index)[HeaderWord.CHECKSUM]

    def payload_words(self, buffer_index: int) -> torch.Tensor:
        """The buffer's payload as int64 words (for checksums; padding bytes are zero)."""
        buffer = self.plan.buffers[buffer_index]
        return self.slot_of(buffer_index)[self.plan.payload_offset:buffer.wire_bytes].view(
            torch.int64)

    def tensor_views(self, buffer_index: int) -> list[torch.Tensor]:
        """Typed, shaped views of the buffer's tensors inside its slot (built once, cached)."""
        views = self._views[buffer_index]
        if views is None:
            buffer = self.plan.buffers[buffer_index]
            slot = self.slot_of(buffer_index)
            views = [typed_view(slot, t.offset_bytes, t.spec.shape, t.spec.dtype)
                     for t in self.plan.tensors_of(buffer)]
            self._views[buffer_index] = views
        return views

    def entries(self, buffer_index: int) -> list[tuple[TensorSpec, torch.Tensor]]:
        """``(spec, view)`` of every tensor or piece in the buffer, as handed to the engine
        (:func:`~mcore_refit.refit.engines.load_into`; cached)."""
        entries = self._entries[buffer_index]
        if entries is None:
            buffer = self.plan.buffers[buffer_index]
            entries = list(zip((t.spec for t in self.plan.tensors_of(buffer)),
                               self.tensor_views(buffer_index), strict=True))
            self._entries[buffer_index] = entries
        return entries

    def pack_from(self, buffer_index: int, reader: SourceReader, *, batched: bool,
                  observe: Callable[[torch.Tensor], None] | None = None) -> None:
        """Pull the buffer's tensors from ``reader`` and copy them into their views.

        ``batched=False`` copies each tensor before asking the source for the next one (the
        ``WeightSource`` contract: a tensor is valid until the next item is requested).
        ``batched=True`` is for sources whose tensors stay valid while referenced: one
        ``_foreach_copy_`` per dtype then packs the whole buffer with little per-tensor work.
        ``observe`` sees every source tensor (e.g. to digest it) before it is released.
        """
        buffer = self.plan.buffers[buffer_index]
        planned = self.plan.tensors_of(buffer)
        if batched:
            tensors = [reader.next_tensor(p) for p in planned]
            if observe is not None:
                for tensor in tensors:
                    observe(tensor)
            self.pack(buffer_index, tensors)
            return
        with torch.no_grad():
            for entry, view in zip(planned, self.tensor_views(buffer_index), strict=True):
                tensor = reader.next_tensor(entry)
                if observe is not None:
                    observe(tensor)
                if isinstance(tensor, Piecewise):
                    torch._foreach_copy_(*tensor.copy_pairs(view))
                else:
                    view.copy_(tensor)

    def pack(self, buffer_index: int, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` (validated against the plan) into their views, one batch per dtype.

        Runs on the current stream: a tensor the source produced on that stream is consumed
        there too, so the allocator may reuse its memory as soon as the source drops it.
        """
        views = self.tensor_views(buffer_index)
        assert len(tensors) == len(views), (len(tensors), len(views))
        with torch.no_grad():
            for positions in self._dtype_groups(buffer_index):
                chosen = range(len(views)) if positions is None else positions
                destinations, sources = [], []
                for i in chosen:
                    if isinstance(tensors[i], Piecewise):
                        into, runs = tensors[i].copy_pairs(views[i])
                        destinations.extend(into)
                        sources.extend(runs)
                    else:
                        destinations.append(views[i])
                        sources.append(tensors[i])
                torch._foreach_copy_(destinations, sources)

    def close(self) -> None:
        self.slots.clear()
        self._views = [None] * self.plan.num_buffers
        self._entries = [None] * self.plan.num_buffers

    def _dtype_groups(self, buffer_index: int) -> list[list[int] | None]:
        # [None] means "one dtype: copy the whole buffer in one batch".
        groups = self._groups[buffer_index]
        if groups is None:
            by_dtype: dict[torch.dtype, list[int]] = {}
            buffer = self.plan.buffers[buffer_index]
            for position, planned in enumerate(self.plan.tensors_of(buffer)):
                by_dtype.setdefault(planned.spec.dtype, []).append(position)
            groups = [None] if len(by_dtype) == 1 else list(by_dtype.values())
            self._groups[buffer_index] = groups
        return groups


class StreamedSlots:
    """A side's slots with a CUDA stream and events per slot (streams and events are None on
    CPU): ``released`` is recorded after a slot's last local use (a pack or a load), ``moved``
    once its bytes left or arrived."""

    def __init__(self, slots: BufferSlots, streams: DeviceStreams) -> None:
        self.slots = slots
        count = slots.plan.num_held_slots
        self.streams = [streams.new_stream() for _ in range(count)]
        self.released = [streams.new_event() for _ in range(count)]
        self.moved = [streams.new_event() for _ in range(count)]


def typed_view(memory: torch.Tensor, offset: int, shape: Sequence[int],
               dtype: torch.dtype) -> torch.Tensor:
    """The ``dtype`` tensor of ``shape`` at byte ``offset`` of ``memory`` (flat ``uint8``)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return memory[offset:offset + nbytes].view(dtype).view(tuple(shape))


def packed_offsets(layout: Sequence[tuple[Sequence[int], torch.dtype]], *,
                   alignment: int) -> tuple[list[int], int]:
    """Byte offsets of ``(shape, dtype)`` tensors laid out one after another in one allocation,
    each at a multiple of ``alignment``, and the bytes the allocation needs."""
    offsets, end = [], 0
    for shape, dtype in layout:
        offsets.append(end)
        end = align_up(end + math.prod(shape) * dtype.itemsize, alignment)
    return offsets, end


def write_header(slots: BufferSlots, buffer_index: int, *, refit_index: int,
                 status: BufferStatus, checksum: bool, staging: torch.Tensor) -> None:
    """Write buffer ``buffer_index``'s header into its slot (and, with ``checksum``, the sum of
    its payload), on the current stream. ``staging`` is a host tensor of at least
    ``HEADER_WORDS`` int64 words that no pending copy still reads (pinned on CUDA)."""
    plan = slots.plan
    header = BufferHeader(refit_index=refit_index, buffer_index=buffer_index, status=status,
                          wire_bytes=plan.buffers[buffer_index].wire_bytes,
                          fingerprint_word=plan.fingerprint_words[0],
                          checksum=0 if checksum else None)
    staging[:HEADER_WORDS] = torch.tensor(header.to_words(), dtype=torch.int64)
    slots.header_view(buffer_index).copy_(staging[:HEADER_WORDS], non_blocking=True)
    if checksum:
        buffer_checksum(slots.payload_words(buffer_index), out=slots.checksum_word(buffer_index))
