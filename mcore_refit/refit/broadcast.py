"""Non-colocated transport: packed buffers broadcast over an explicit process group.

The refit group holds the sender (the trainer rank that owns the export, at ``src_rank`` *within
the group*) and the inference ranks, each receiving every buffer. Both ends use N slots
(``refit.num_buffers``) round-robin:

sender, per buffer: wait until the slot's previous broadcast finished → pull the buffer's tensors
from the source and pack them on the current stream (where the source produced them) → write
the header (and checksum) → the slot's stream waits for the pack and issues the broadcast. So
exporting and packing buffer k+1 overlaps broadcasting buffer k.

receiver, per buffer: broadcasts are posted ahead into free slots (on each slot's stream, after
the slot's previous load) → wait for buffer k → check its header → ``engine.load_weights`` on
views into the slot, while buffer k+1 is still arriving.

Each refit starts with a fingerprint check and ends with a status exchange, so a failure on any
rank (a plan mismatch, a source error, an engine raising, a checksum or verification mismatch)
raises :class:`~mcore_refit.refit.transport.RefitError` on every rank; a rank that failed keeps
taking part in the remaining broadcasts without loading, so nobody hangs. Works with NCCL (CUDA
tensors) and gloo (CPU tensors; streams and events are no-ops). See :mod:`.group` for timeouts.
"""

from __future__ import annotations

import time
import traceback

import torch
import torch.distributed as dist

from mcore_refit.refit.buffers import BufferHeader, BufferSlots, BufferStatus, SourceReader
from mcore_refit.refit.checksum import DigestRecorder, buffer_checksum, verify_engine_weights
from mcore_refit.refit.config import RefitConfig
from mcore_refit.refit.group import (
    FLAG_CHECKSUMS,
    FLAG_VERIFY,
    GroupCollectives,
    PendingTransfer,
    RefitExchange,
)
from mcore_refit.refit.plan import RefitPlan
from mcore_refit.refit.streams import DeviceMemoryProbe, DeviceStreams
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transport import RefitReceiver, RefitSender, WeightLoader


class _SlotPipeline:
    """Per-plan state of one end: slots, a stream and events per slot, staging, timing events."""

    def __init__(self, *, plan: RefitPlan, streams: DeviceStreams, config: RefitConfig) -> None:
        self.plan = plan
        self.config = config
        self.streams = streams
        self.slots = BufferSlots.allocate(plan, streams.device)
        num_slots = plan.num_slots_total
        self.slot_streams = [streams.new_stream() for _ in range(num_slots)]
        # Recorded on the current stream when the slot's last use there (pack or load) is queued.
        self.slot_released = [streams.new_event() for _ in range(num_slots)]
        self.transfer_done = [streams.new_event() for _ in range(num_slots)]
        # Header words go through host staging memory per slot (pinned on CUDA).
        self.staging = [streams.staging(16, torch.int64) for _ in range(num_slots)]
        self.device_checksums = torch.zeros(num_slots, dtype=torch.int64, device=streams.device)
        self.timing = [[streams.new_event(timing=True) for _ in range(4)]
                       for _ in range(plan.num_buffers)]
        self.memory = DeviceMemoryProbe(streams.device, track_peak=config.track_peak_memory)

    def telemetry(self, *, role: str, refit_index: int) -> RefitTelemetry:
        return RefitTelemetry(
            role=role, transport="broadcast", refit_index=refit_index,
            device=str(self.streams.device), num_tensors=self.plan.num_tensors,
            num_buffers=self.plan.num_buffers, bytes=self.plan.total_bytes,
            buffer_bytes=self.slots.held_bytes,
        )

    def device_time(self, first: int, second: int) -> float:
        """Sum over buffers of the device time between timing events ``first`` and ``second``."""
        return sum(self.streams.elapsed_s(t[first], t[second]) for t in self.timing)

    def window(self, first: int, second: int) -> float:
        """Device time from event ``first`` of the first buffer to ``second`` of the last."""
        return self.streams.elapsed_s(self.timing[0][first], self.timing[-1][second])

    def sync_all(self, what: str) -> None:
        """Wait for every slot stream and the current stream (bounded)."""
        for stream in self.slot_streams:
            if stream is not None:
                done = self.streams.new_event()
                self.streams.record(done, stream)
                self.streams.host_wait(done, timeout_s=self.config.timeout_s, what=what)
        self.streams.synchronize(timeout_s=self.config.timeout_s, what=what)

    def close(self) -> None:
        self.slots.close()


class BroadcastSender(RefitSender):
    """Trainer end of the non-colocated transport.

    ``group`` is the refit process group (``None`` = the default group) and ``src_rank`` this
    process's rank *within that group*. :meth:`prepare` and :meth:`send` are collectives over
    ``group``: call them on every rank of the group, in the same order as the receivers.
    """

    transport_name = "broadcast"
    _PACK_START, _PACK_END, _SEND_START, _SEND_END = range(4)

    def __init__(self, *, plan: RefitPlan, group: dist.ProcessGroup | None, src_rank: int,
                 device: torch.device, config: RefitConfig) -> None:
        super().__init__(plan=plan)
        self._config = config
        self._streams = DeviceStreams(device)
        self._collectives = GroupCollectives(group=group, streams=self._streams)
        if self._collectives.rank != src_rank:
            raise ValueError(
                f"src_rank={src_rank} but this process is group rank "
                f"{self._collectives.rank}; the sender must be the source rank"
            )
        self._exchange = RefitExchange(self._collectives, src_rank=src_rank)
        self._src_rank = src_rank
        self._pipe: _SlotPipeline | None = None

    def prepare(self) -> None:
        """Allocate the buffers and send the plan to the receivers (collective)."""
        if self._pipe is None:
            self._pipe = _SlotPipeline(plan=self.plan, streams=self._streams, config=self._config)
        self._exchange.share_plan(self.plan, timeout_s=self._config.start_timeout_s)

    def send(self, weights, *, refit_index: int, verify: bool = False,
             stable_tensors: bool = False) -> RefitTelemetry:
        assert self._pipe is not None, "call prepare() before send()"
        pipe, config = self._pipe, self._config
        telemetry = pipe.telemetry(role="sender", refit_index=refit_index)
        telemetry.checksums = config.checksums
        start = time.perf_counter()
        pipe.memory.start()
        flags = (FLAG_CHECKSUMS if config.checksums else 0) | (FLAG_VERIFY if verify else 0)
        reader = SourceReader(self.plan, weights)
        try:
            self._exchange.start(self.plan, refit_index=refit_index, flags=flags,
                                 timeout_s=config.timeout_s)
            digests = DigestRecorder(self._streams.device) if verify else None
            failure = self._send_buffers(reader, refit_index=refit_index, digests=digests,
                                         batched=stable_tensors, telemetry=telemetry)
            if failure is None:
                extra = reader.extra()
                if extra is not None:
                    failure = (f"the weight source yielded more than the plan's "
                               f"{self.plan.num_tensors} tensors (next: {extra!r}); rebuild the "
                               "plan when the model changes")
            if failure is not None:
                reader.drain()
            if digests is not None:
                self._send_digests(digests, telemetry=telemetry)
            self._exchange.finish(failure, refit_index=refit_index, timeout_s=config.timeout_s)
        except BaseException:
            # Trainer ranks exporting in lockstep read whole passes: finish ours (a refused
            # start, a timeout) so they are not left inside an export collective.
            reader.drain()
            raise
        pipe.sync_all("the sender's streams at the end of the refit")
        telemetry.total_s = time.perf_counter() - start
        telemetry.verified = True if verify else None
        telemetry.record_memory(pipe.memory.stop())
        if self._streams.is_cuda:
            telemetry.pack_s = pipe.device_time(self._PACK_START, self._PACK_END)
            telemetry.transfer_s = pipe.window(self._SEND_START, self._SEND_END)
        return telemetry

    def close(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None

    def _send_buffers(self, reader: SourceReader, *, refit_index: int,
                      digests: DigestRecorder | None, batched: bool,
                      telemetry: RefitTelemetry) -> str | None:
        pipe, plan, streams = self._pipe, self.plan, self._streams
        timeout_s = self._config.timeout_s
        pending: list[PendingTransfer | None] = [None] * plan.num_slots_total
        failure: str | None = None
        first_issue = time.perf_counter()
        for buffer in plan.buffers:
            slot, events = buffer.slot, pipe.timing[buffer.index]
            if pending[slot] is not None:
                waited = time.perf_counter()
                pending[slot].wait_host(streams, timeout_s=timeout_s)
                telemetry.wait_s += time.perf_counter() - waited
            if failure is None:
                try:
                    packed, exported = time.perf_counter(), reader.export_s
                    streams.record(events[self._PACK_START])
                    pipe.slots.pack_from(buffer.index, reader, batched=batched, observe=digests)
                    streams.record(events[self._PACK_END])
                    telemetry.pack_s += (time.perf_counter() - packed
                                         - (reader.export_s - exported))
                except Exception:
                    failure = f"packing buffer {buffer.index}: {traceback.format_exc()}"
            status = BufferStatus.OK if failure is None else BufferStatus.ABORTED
            self._write_header(buffer.index, refit_index=refit_index, status=status,
                               telemetry=telemetry)
            stream = pipe.slot_streams[slot]
            # The slot's stream (and so NCCL) waits for the pack and header on the current one.
            streams.record(pipe.slot_released[slot])
            streams.stream_wait(pipe.slot_released[slot], stream)
            streams.record(events[self._SEND_START], stream)
            pending[slot] = self._collectives.broadcast_async(
                pipe.slots.wire_view(buffer.index), src_rank=self._src_rank, stream=stream,
                done=pipe.transfer_done[slot],
                what=f"the broadcast of buffer {buffer.index}/{plan.num_buffers} of refit "
                     f"{refit_index} to the receivers",
            )
            streams.record(events[self._SEND_END], stream)
        waited = time.perf_counter()
        for transfer in pending:
            if transfer is not None:
                transfer.wait_host(streams, timeout_s=timeout_s)
        telemetry.wait_s += time.perf_counter() - waited
        telemetry.export_s = reader.export_s
        telemetry.transfer_s = time.perf_counter() - first_issue
        if digests is not None:
            telemetry.pack_s -= digests.seconds
        return failure

    def _write_header(self, buffer_index: int, *, refit_index: int, status: BufferStatus,
                      telemetry: RefitTelemetry) -> None:
        pipe, plan = self._pipe, self.plan
        buffer = plan.buffers[buffer_index]
        checksums = self._config.checksums and status == BufferStatus.OK
        header = BufferHeader(refit_index=refit_index, buffer_index=buffer_index, status=status,
                              used_bytes=buffer.used_bytes,
                              fingerprint_word=plan.fingerprint_words[0],
                              checksum=0 if checksums else None)
        words = header.to_words()
        staging = pipe.staging[buffer.slot]
        staging[:len(words)] = torch.tensor(words, dtype=torch.int64)
        # Non-blocking from pinned memory: this staging row is rewritten only after the slot's
        # broadcast, which is ordered after this copy, completed.
        header_view = pipe.slots.header_view(buffer_index)
        header_view.copy_(staging[:len(words)], non_blocking=True)
        if checksums:
            started = time.perf_counter()
            buffer_checksum(pipe.slots.payload_words(buffer_index), out=header_view[5])
            telemetry.checksum_s += time.perf_counter() - started

    def _send_digests(self, digests: DigestRecorder, *, telemetry: RefitTelemetry) -> None:
        started = time.perf_counter()
        self._collectives.broadcast(digests.table(self.plan.num_tensors),
                                    src_rank=self._src_rank,
                                    what="the sender's weight digests",
                                    timeout_s=self._config.timeout_s)
        telemetry.verify_s = digests.seconds + time.perf_counter() - started


class BroadcastReceiver(RefitReceiver):
    """Engine end of the non-colocated transport (one per inference rank of the group).

    ``plan=None`` takes the sender's plan at :meth:`prepare`; a given plan is kept and checked
    against the sender's at the start of every refit. :meth:`prepare` and :meth:`receive` are
    collectives over ``group``: call them on every rank, in the same order as the sender.
    """

    transport_name = "broadcast"
    _RECV_START, _RECV_END, _LOAD_START, _LOAD_END = range(4)

    def __init__(self, *, group: dist.ProcessGroup | None, src_rank: int, device: torch.device,
                 config: RefitConfig, plan: RefitPlan | None = None) -> None:
        self._config = config
        self._streams = DeviceStreams(device)
        self._collectives = GroupCollectives(group=group, streams=self._streams)
        if self._collectives.rank == src_rank:
            raise ValueError(f"group rank {src_rank} is the sender; receivers must be other ranks")
        self._exchange = RefitExchange(self._collectives, src_rank=src_rank)
        self._src_rank = src_rank
        self._own_plan = plan
        self._pipe: _SlotPipeline | None = None

    @property
    def plan(self) -> RefitPlan | None:
        return self._pipe.plan if self._pipe is not None else self._own_plan

    def prepare(self) -> None:
        """Receive the sender's plan (collective) and allocate the buffers."""
        sent = self._exchange.share_plan(None, timeout_s=self._config.start_timeout_s)
        plan = self._own_plan if self._own_plan is not None else sent
        if self._pipe is None or self._pipe.plan != plan:
            if self._pipe is not None:
                self._pipe.close()
            self._pipe = _SlotPipeline(plan=plan, streams=self._streams, config=self._config)

    def receive(self, engine: WeightLoader) -> RefitTelemetry:
        assert self._pipe is not None, "call prepare() before receive()"
        pipe, config = self._pipe, self._config
        start = time.perf_counter()
        pipe.memory.start()
        refit_index, flags = self._exchange.start(pipe.plan, refit_index=0, flags=0,
                                                  timeout_s=config.start_timeout_s)
        telemetry = pipe.telemetry(role="receiver", refit_index=refit_index)
        telemetry.checksums = bool(flags & FLAG_CHECKSUMS)
        failure = self._receive_buffers(engine, refit_index=refit_index,
                                        checksums=telemetry.checksums, telemetry=telemetry)
        if flags & FLAG_VERIFY:
            failure = self._verify(engine, failure=failure, telemetry=telemetry)
        self._exchange.finish(failure, refit_index=refit_index, timeout_s=config.timeout_s)
        pipe.sync_all("the receiver's streams at the end of the refit")
        telemetry.total_s = time.perf_counter() - start
        telemetry.record_memory(pipe.memory.stop())
        if self._streams.is_cuda:
            telemetry.load_s = pipe.device_time(self._LOAD_START, self._LOAD_END)
            telemetry.transfer_s = pipe.window(self._RECV_START, self._RECV_END)
        return telemetry

    def close(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None

    def _receive_buffers(self, engine: WeightLoader, *, refit_index: int, checksums: bool,
                         telemetry: RefitTelemetry) -> str | None:
        plan, timeout_s = self._pipe.plan, self._config.timeout_s
        pending: dict[int, PendingTransfer] = {}
        slot_busy = [False] * plan.num_slots_total
        failure: str | None = None
        next_post = 0
        first_post = time.perf_counter()
        for buffer in plan.buffers:
            # Post every broadcast whose slot is free, in plan order (the sender's order).
            while next_post < plan.num_buffers and not slot_busy[plan.buffers[next_post].slot]:
                self._post(next_post, refit_index=refit_index, pending=pending)
                slot_busy[plan.buffers[next_post].slot] = True
                next_post += 1
            what = (f"buffer {buffer.index}/{plan.num_buffers} of refit {refit_index} from "
                    f"group rank {self._src_rank}")
            waited = time.perf_counter()
            pending.pop(buffer.index).wait_stream(self._streams, timeout_s=timeout_s)
            header, checksum = self._read_header(buffer.index, checksums=checksums, what=what)
            telemetry.wait_s += time.perf_counter() - waited
            if failure is None:
                failure = self._check_header(header, checksum, buffer.index,
                                             refit_index=refit_index)
            if failure is None:
                failure = self._load(engine, buffer.index, telemetry=telemetry)
            self._streams.record(self._pipe.slot_released[buffer.slot])
            slot_busy[buffer.slot] = False
        telemetry.transfer_s = time.perf_counter() - first_post
        return failure

    def _post(self, buffer_index: int, *, refit_index: int,
              pending: dict[int, PendingTransfer]) -> None:
        pipe, streams = self._pipe, self._streams
        slot = pipe.plan.buffers[buffer_index].slot
        events = pipe.timing[buffer_index]
        stream = pipe.slot_streams[slot]
        # The slot's stream waits for the last load from this slot before bytes land in it.
        streams.stream_wait(pipe.slot_released[slot], stream)
        streams.record(events[self._RECV_START], stream)
        pending[buffer_index] = self._collectives.broadcast_async(
            pipe.slots.wire_view(buffer_index), src_rank=self._src_rank, stream=stream,
            done=pipe.transfer_done[slot],
            what=f"buffer {buffer_index}/{pipe.plan.num_buffers} of refit {refit_index} from "
                 f"group rank {self._src_rank}",
        )
        streams.record(events[self._RECV_END], stream)

    def _read_header(self, buffer_index: int, *, checksums: bool,
                     what: str) -> tuple[BufferHeader | str, int | None]:
        """The buffer's header (or why it is unreadable) and, if asked, the payload checksum.

        The one host synchronisation per buffer: the next buffer's broadcast is already posted.
        """
        pipe = self._pipe
        slot = pipe.plan.buffers[buffer_index].slot
        staging = pipe.staging[slot]
        staging[:8].copy_(pipe.slots.header_view(buffer_index), non_blocking=True)
        if checksums:
            buffer_checksum(pipe.slots.payload_words(buffer_index),
                            out=pipe.device_checksums[slot])
            staging[8:9].copy_(pipe.device_checksums[slot:slot + 1], non_blocking=True)
        self._streams.synchronize(timeout_s=self._config.timeout_s, what=what)
        words = staging.tolist()
        try:
            header = BufferHeader.from_words(words[:8])
        except ValueError as error:
            return f"buffer {buffer_index}: {error}", None
        return header, (words[8] if checksums else None)

    def _check_header(self, header: BufferHeader | str, checksum: int | None, buffer_index: int,
                      *, refit_index: int) -> str | None:
        if isinstance(header, str):
            return header
        if header.status == BufferStatus.ABORTED:
            return "the sender aborted the refit"
        try:
            header.check_expected(plan=self._pipe.plan, refit_index=refit_index,
                                  buffer_index=buffer_index)
        except ValueError as error:
            return f"buffer {buffer_index}: {error}"
        if checksum is not None and header.checksum != checksum:
            names = self._pipe.plan.buffer_names(buffer_index)
            return (f"checksum mismatch in buffer {buffer_index}: sent {header.checksum}, "
                    f"received {checksum} (tensors {names[0]!r} .. {names[-1]!r})")
        return None

    def _load(self, engine: WeightLoader, buffer_index: int, *,
              telemetry: RefitTelemetry) -> str | None:
        events = self._pipe.timing[buffer_index]
        started = time.perf_counter()
        self._streams.record(events[self._LOAD_START])
        try:
            engine.load_weights(self._pipe.slots.named_views(buffer_index))
        except Exception:
            return f"engine.load_weights on buffer {buffer_index}: {traceback.format_exc()}"
        finally:
            self._streams.record(events[self._LOAD_END])
            telemetry.load_s += time.perf_counter() - started
        return None

    def _verify(self, engine: WeightLoader, *, failure: str | None,
                telemetry: RefitTelemetry) -> str | None:
        started = time.perf_counter()
        plan = self._pipe.plan
        table = torch.zeros(plan.num_tensors, 3, dtype=torch.int64, device=self._streams.device)
        self._collectives.broadcast(table, src_rank=self._src_rank,
                                    what="the sender's weight digests",
                                    timeout_s=self._config.timeout_s)
        if failure is None:
            failure = verify_engine_weights(engine, plan.names, table)
            telemetry.verified = failure is None
        telemetry.verify_s = time.perf_counter() - started
        return failure

