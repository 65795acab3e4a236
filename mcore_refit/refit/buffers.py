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
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from mcore_refit.refit.plan import HEADER_BYTES, PlannedTensor, RefitPlan

# "MCREFIT1" as a little-endian int64.
HEADER_MAGIC = int.from_bytes(b"MCREFIT1", "little")
HEADER_WORDS = HEADER_BYTES // 8


class BufferStatus(enum.IntEnum):
    OK = 0
    # The sender failed before packing this buffer; its bytes are stale and must not be loaded.
    ABORTED = 1


class _Word(enum.IntEnum):
    MAGIC = 0
    REFIT_INDEX = 1
    BUFFER_INDEX = 2
    STATUS = 3
    USED_BYTES = 4
    CHECKSUM = 5
    HAS_CHECKSUM = 6
    FINGERPRINT = 7


@dataclass(frozen=True, kw_only=True)
class BufferHeader:
    """The header at the start of every buffer."""

    refit_index: int
    buffer_index: int
    status: BufferStatus
    used_bytes: int
    fingerprint_word: int
    checksum: int | None = None

    def to_words(self) -> list[int]:
        words = [0] * HEADER_WORDS
        words[_Word.MAGIC] = HEADER_MAGIC
        words[_Word.REFIT_INDEX] = self.refit_index
        words[_Word.BUFFER_INDEX] = self.buffer_index
        words[_Word.STATUS] = int(self.status)
        words[_Word.USED_BYTES] = self.used_bytes
        words[_Word.CHECKSUM] = self.checksum if self.checksum is not None else 0
        words[_Word.HAS_CHECKSUM] = int(self.checksum is not None)
        words[_Word.FINGERPRINT] = self.fingerprint_word
        return words

    @classmethod
    def from_words(cls, words: Sequence[int]) -> BufferHeader:
        if len(words) != HEADER_WORDS or words[_Word.MAGIC] != HEADER_MAGIC:
            raise ValueError("buffer header has no valid magic word: the buffer was not packed "
                             "by a refit sender (or was overwritten)")
        try:
            status = BufferStatus(words[_Word.STATUS])
        except ValueError:
            raise ValueError(f"buffer header has unknown status {words[_Word.STATUS]}") from None
        return cls(
            refit_index=words[_Word.REFIT_INDEX], buffer_index=words[_Word.BUFFER_INDEX],
            status=status, used_bytes=words[_Word.USED_BYTES],
            fingerprint_word=words[_Word.FINGERPRINT],
            checksum=words[_Word.CHECKSUM] if words[_Word.HAS_CHECKSUM] else None,
        )

    def check_expected(self, *, plan: RefitPlan, refit_index: int, buffer_index: int) -> None:
        """Raise ``ValueError`` unless this is the header of ``buffer_index`` of ``refit_index``."""
        expected = (refit_index, buffer_index, plan.buffers[buffer_index].used_bytes,
                    plan.fingerprint_words[0])
        found = (self.refit_index, self.buffer_index, self.used_bytes, self.fingerprint_word)
        if found != expected:
            raise ValueError(
                "buffer header (refit, buffer, used bytes, plan word) = "
                f"{found}, expected {expected}: sender and receiver are out of step"
            )


class BufferSlots:
    """One persistent ``uint8`` tensor per plan slot, plus precomputed views into them.

    Allocate with :meth:`allocate` (zero-filled, so alignment padding is always zero and
    checksums over whole buffers agree on both sides) or wrap tensors mapped from another process.
    """

    def __init__(self, *, plan: RefitPlan, slots: Sequence[torch.Tensor]) -> None:
        if len(slots) != plan.num_slots_total:
            raise ValueError(f"plan needs {plan.num_slots_total} slots, got {len(slots)}")
        for index, slot in enumerate(slots):
            if slot.dtype != torch.uint8 or slot.dim() != 1 or not slot.is_contiguous():
                raise ValueError(f"slot {index} must be a contiguous 1-D uint8 tensor")
            if slot.numel() < plan.slot_bytes(index):
                raise ValueError(
                    f"slot {index} has {slot.numel()} bytes, the plan needs "
                    f"{plan.slot_bytes(index)}"
                )
        self.plan = plan
        self.slots: list[torch.Tensor] = list(slots)
        self.device = self.slots[0].device
        self._views: list[list[torch.Tensor] | None] = [None] * plan.num_buffers
        self._named: list[list[tuple[str, torch.Tensor]] | None] = [None] * plan.num_buffers
        self._groups: list[list[list[int]] | None] = [None] * plan.num_buffers

    @classmethod
    def allocate(cls, plan: RefitPlan, device: torch.device) -> BufferSlots:
        """Allocate the plan's slots on ``device`` (the only allocation a transport makes)."""
        slots = [torch.zeros(plan.slot_bytes(s), dtype=torch.uint8, device=device)
                 for s in range(plan.num_slots_total)]
        return cls(plan=plan, slots=slots)

    @property
    def held_bytes(self) -> int:
        return sum(slot.numel() for slot in self.slots)

    def slot_of(self, buffer_index: int) -> torch.Tensor:
        return self.slots[self.plan.buffers[buffer_index].slot]

    def wire_view(self, buffer_index: int) -> torch.Tensor:
        """The bytes a transport moves for this buffer: header and payload."""
        return self.slot_of(buffer_index)[:self.plan.buffers[buffer_index].used_bytes]

    def header_view(self, buffer_index: int) -> torch.Tensor:
        return self.slot_of(buffer_index)[:HEADER_BYTES].view(torch.int64)

    def payload_words(self, buffer_index: int) -> torch.Tensor:
        """The buffer's payload as int64 words (for checksums; padding bytes are zero)."""
        buffer = self.plan.buffers[buffer_index]
        return self.slot_of(buffer_index)[self.plan.payload_offset:buffer.used_bytes].view(
            torch.int64)

    def tensor_views(self, buffer_index: int) -> list[torch.Tensor]:
        """Typed, shaped views of the buffer's tensors inside its slot (built once, cached)."""
        views = self._views[buffer_index]
        if views is None:
            buffer = self.plan.buffers[buffer_index]
            slot = self.slots[buffer.slot]
            views = [_typed_view(slot, t.offset_bytes, t.spec.shape, t.spec.dtype)
                     for t in self.plan.tensors_of(buffer)]
            self._views[buffer_index] = views
        return views

    def named_views(self, buffer_index: int) -> list[tuple[str, torch.Tensor]]:
        """``(name, view)`` pairs of the buffer, as handed to ``load_weights`` (cached)."""
        named = self._named[buffer_index]
        if named is None:
            named = list(zip(self.plan.buffer_names(buffer_index),
                             self.tensor_views(buffer_index), strict=True))
            self._named[buffer_index] = named
        return named

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
                if positions is None:
                    torch._foreach_copy_(views, list(tensors))
                else:
                    torch._foreach_copy_([views[i] for i in positions],
                                         [tensors[i] for i in positions])

    def close(self) -> None:
        self.slots.clear()
        self._views = [None] * self.plan.num_buffers
        self._named = [None] * self.plan.num_buffers

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


class SourceReader:
    """Pulls a plan's tensors from a weight iterator in plan order, checking each one.

    Raises ``ValueError`` naming the first tensor that differs from the plan in name, shape or
    dtype, or the point where the source ended early. ``export_s`` accumulates the time spent
    inside the source (the export).
    """

    def __init__(self, plan: RefitPlan, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._plan = plan
        self._weights = weights
        self.export_s = 0.0

    def next_tensor(self, planned: PlannedTensor) -> torch.Tensor:
        start = time.perf_counter()
        item = next(self._weights, None)
        self.export_s += time.perf_counter() - start
        spec = planned.spec
        if item is None:
            raise ValueError(
                f"the weight source ended after {planned.index} tensors; the refit plan has "
                f"{self._plan.num_tensors} (next expected: {spec.name!r})"
            )
        name, tensor = item
        if name != spec.name or tensor.dtype != spec.dtype or tensor.shape != spec.shape:
            raise ValueError(
                f"the weight source yielded {name!r} {tuple(tensor.shape)} {tensor.dtype} at "
                f"position {planned.index}, the refit plan expects {spec.name!r} {spec.shape} "
                f"{spec.dtype}; rebuild the plan when the model changes"
            )
        return tensor

    def extra(self) -> str | None:
        """The name of a tensor the source yields beyond the plan, if any."""
        item = next(self._weights, None)
        return None if item is None else item[0]

    def drain(self) -> None:
        """Consume the rest, so trainer ranks exporting in lockstep do not hang."""
        try:
            for _ in self._weights:
                pass
        except Exception:
            pass  # the source itself failed: that error is already the refit's failure


def _typed_view(slot: torch.Tensor, offset: int, shape: tuple[int, ...],
                dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * dtype.itemsize
    return slot[offset:offset + nbytes].view(dtype).view(shape)
