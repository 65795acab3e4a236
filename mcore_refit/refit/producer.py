"""Filling a source rank's buffers during one refit: pack, header, checksum, digests.

Shared by the senders of both transports. A failure (a source error, a tensor that differs from
the plan) marks this and every later buffer of the rank ``ABORTED`` in its header, but the rank
keeps reading its source buffer by buffer and keeps taking part in every exchange, so no rank
that reads a collective source in step, and no receiver, is left waiting; the refit's finish
exchange then raises the failure on every rank.
"""

from __future__ import annotations

import time

import torch

from mcore_refit.refit.buffers import BufferSlots, BufferStatus, write_header
from mcore_refit.refit.checksum import DigestRecorder
from mcore_refit.refit.errors import RefitError, failed
from mcore_refit.refit.plan import PlannedBuffer, RefitPlan
from mcore_refit.refit.source import RefitPass, SourceReader
from mcore_refit.refit.streams import DeviceStreams
from mcore_refit.refit.telemetry import RefitTelemetry


class BufferProducer:
    """Packs the buffers ``rank`` is the source of into ``slots`` (on the current stream)."""

    def __init__(self, *, plan: RefitPlan, slots: BufferSlots, refit_pass: RefitPass, rank: int,
                 streams: DeviceStreams, checksums: bool, verify: bool,
                 telemetry: RefitTelemetry) -> None:
        self._plan = plan
        self._slots = slots
        self._pass = refit_pass
        self._rank = rank
        self._streams = streams
        self._checksums = checksums
        self._telemetry = telemetry
        self._reader = SourceReader(plan, refit_pass.own_weights())
        self._staging = [streams.staging(16, torch.int64) for _ in range(plan.num_held_slots)]
        self.digests = DigestRecorder(streams.device) if verify else None
        # Plan positions of the tensors digested so far (this rank's, in order).
        self._digested: list[int] = []
        self.failure: RefitError | None = None

    def exchange(self, buffer: PlannedBuffer, *, timeout_s: float) -> None:
        """This rank's part in the source's exchange for ``buffer`` (every rank, every buffer)."""
        try:
            self._pass.exchange(buffer, timeout_s=timeout_s)
        except Exception as error:
            self._fail(failed(f"preparing buffer {buffer.index}", error))

    def produce(self, buffer: PlannedBuffer, *, refit_index: int) -> BufferStatus:
        """Pack ``buffer`` (this rank is its source) and write its header; its status."""
        assert buffer.source == self._rank, (buffer, self._rank)
        telemetry = self._telemetry
        started, exported = time.perf_counter(), self._reader.export_s
        digested = self.digests.seconds if self.digests is not None else 0.0
        if self.failure is None:
            try:
                self._slots.pack_from(buffer.index, self._reader,
                                      batched=self._pass.stable_tensors, observe=self.digests)
                self._digested.extend(t.index for t in self._plan.tensors_of(buffer))
            except Exception as error:
                self._fail(failed(f"packing buffer {buffer.index}", error))
        else:
            self._reader.skip(self._plan.tensors_of(buffer))
        status = BufferStatus.OK if self.failure is None else BufferStatus.ABORTED
        write_header(self._slots, buffer.index, refit_index=refit_index, status=status,
                     checksum=self._checksums and status == BufferStatus.OK,
                     staging=self._staging[self._slots.slot_index(buffer.index)])
        digest_s = self.digests.seconds - digested if self.digests is not None else 0.0
        telemetry.pack_s += (time.perf_counter() - started - (self._reader.export_s - exported)
                             - digest_s)
        telemetry.export_s = self._reader.export_s
        return status

    def finish(self) -> RefitError | None:
        """After the last buffer: the failure, if any (including a source with extra tensors)."""
        if self.failure is None:
            extra = self._reader.extra()
            if extra is not None:
                self._fail(RefitError(f"the weight source yielded more than the plan's tensors "
                                      f"(next: {extra!r}); rebuild the plan when the model "
                                      "changes"))
        if self.digests is not None:
            self._telemetry.verify_s += self.digests.seconds
        return self.failure

    def digest_rows(self) -> list[list[int]]:
        """``[plan position, d0, d1, d2]`` for every tensor this rank digested (verification)."""
        if self.digests is None or not self._digested or self.failure is not None:
            return []
        table = torch.stack(self.digests.rows).cpu().tolist()
        return [[index, *row] for index, row in zip(self._digested, table, strict=True)]

    def _fail(self, error: RefitError) -> None:
        """Record the rank's first failure (the refit goes on, so no peer waits alone)."""
        if self.failure is None:
            self.failure = error
