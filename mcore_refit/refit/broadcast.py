"""Non-colocated transport: every buffer goes from its source trainer rank to every inference rank.

A split job (:class:`~mcore_refit.distributed.SplitJob`) has trainer ranks and inference ranks.
Every buffer of the plan has a source: the trainer rank whose export fills it. From there it
reaches each inference rank over one of two links (:class:`Placement` says which):

- **broadcast**: over the source's own data group (the source and every inference rank on another
  device; NCCL on GPUs), from one of the source's slots into one of the receiver's. Sources have
  a group each, so buffers of different sources move at once;
- **IPC**: an inference rank on the source's own device maps the source's slots once (CUDA IPC,
  shared memory on CPU) and loads each buffer straight from them; NCCL refuses two ranks of one
  device in a communicator, and the copy stays on the device.

Both ends use ``plan.num_slots`` slots round-robin with a CUDA stream and events each: exporting
and packing buffer k+1 overlaps moving buffer k, and a receiver loads buffer k while k+1 arrives.
Receivers post a broadcast only once the refit has started (a host-side exchange) and only into a
free slot, so no rank holds a GPU kernel waiting for a peer between refits.

All waiting for peers is on the host, over the control plane (:mod:`mcore_refit.control`): the
start of a refit (:mod:`.rounds`: plan fingerprints, switches), every IPC buffer's ready and
ACK messages, and the final outcome exchange, which raises a failure on every rank, naming the
rank. A rank that failed keeps taking part in every exchange and transfer without loading, so
nobody waits alone. Works with NCCL (CUDA tensors) and gloo (CPU tensors; streams and events are
no-ops).
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from mcore_refit.control import ControlGroup
from mcore_refit.distributed import Placement
from mcore_refit.refit.buffers import BufferHeader, BufferSlots, BufferStatus
from mcore_refit.refit.checksum import DIGEST_WORDS, buffer_checksum, verify_engine_weights
from mcore_refit.refit.config import TransportOptions
from mcore_refit.refit.fanout import BroadcastFanout, Link, RelayFanout, check_same_fanout
from mcore_refit.refit.group import PendingTransfer
from mcore_refit.refit.ipc_memory import (
    create_shared_cpu_slot,
    describe_slot,
    open_slot,
    private_runtime_dir,
)
from mcore_refit.refit.ipc_owners import OwnerRecord, claim_owner, sweep_stale_files
from mcore_refit.refit.plan import PlannedBuffer, RefitPlan, plan_from_json
from mcore_refit.refit.producer import BufferProducer
from mcore_refit.refit.rounds import RefitRounds
from mcore_refit.refit.source import RefitPass
from mcore_refit.refit.streams import DeviceMemoryProbe, DeviceStreams
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transport import (
    RefitError,
    RefitReceiver,
    RefitSender,
    WeightLoader,
    load_into,
)
from mcore_refit.refit.wire import SlotHandle, WireError, from_fields, to_fields

# Tags of the control plane's point-to-point messages between a source and an IPC receiver:
# the slots' handles (JSON, once); per buffer, [refit, buffer, status] and [buffer, ok] words.
_TAG_SLOTS, _TAG_READY, _TAG_ACK = 1, 2, 3


class _Slots:
    """A side's slots with a CUDA stream and events per slot (streams are None on CPU)."""

    def __init__(self, slots: BufferSlots, streams: DeviceStreams) -> None:
        self.slots = slots
        count = slots.plan.num_held_slots
        self.streams = [streams.new_stream() for _ in range(count)]
        # Recorded on the current stream after the slot's last local use (a pack or a load).
        self.released = [streams.new_event() for _ in range(count)]
        self.moved = [streams.new_event() for _ in range(count)]


class BroadcastSender(RefitSender):
    """Trainer end of the non-colocated transport, on every trainer rank of a split job.

    ``data_group`` is this rank's own broadcast group (None when it has no remote receivers);
    ``control`` spans every rank of the job. :meth:`prepare` and :meth:`send` are collectives over
    all of them: call them on every rank, in the same order as the receivers.
    """

    transport_name = "broadcast"

    def __init__(self, *, plan: RefitPlan, placement: Placement, rank: int,
                 control: ControlGroup, data_group: dist.ProcessGroup | None,
                 device: torch.device, options: TransportOptions,
                 cpu_device_id: str | None = None,
                 links: dict[Link, dist.ProcessGroup] | None = None) -> None:
        super().__init__(plan=plan)
        self._placement = placement
        self._rank = rank
        self._control = control
        self._options = options
        self._streams = DeviceStreams(device, peers=getattr(control, "peers", None))
        self._rounds = RefitRounds(control, name_of=placement.name_of)
        self._ipc = placement.ipc_receivers(rank) if rank in plan.sources else []
        self._remote = placement.remote_receivers(rank) if rank in plan.sources else []
        self._fanout = None
        if self._remote and options.fanout == "relay":
            self._fanout = RelayFanout(plan=plan, placement=placement, me=rank,
                                       links=links or {}, streams=self._streams)
        elif self._remote:
            if data_group is None:
                raise ValueError(f"trainer rank {rank} sends to inference ranks {self._remote} "
                                 "but has no data group")
            self._fanout = BroadcastFanout(data_groups={rank: data_group}, streams=self._streams)
        self._cpu_device_id = cpu_device_id
        self._owner: OwnerRecord | None = None
        self._pipe: _Slots | None = None
        self._slot_files: list[Path] = []
        self._memory = DeviceMemoryProbe(self._streams.device,
                                         track_peak=options.track_peak_memory)

    def prepare(self) -> None:
        """Allocate this rank's slots, hand IPC receivers their handles, and send the plan to
        the inference ranks (collective)."""
        timeout_s = self._options.start_timeout_s
        self._control.broadcast_json(self.plan.to_json() if self._rank == 0 else None, src=0,
                                     what="the refit plan from trainer rank 0",
                                     timeout_s=timeout_s)
        check_same_fanout(self._control, self._options, name_of=self._placement.name_of)
        if self._pipe is None and self._rank in self.plan.sources:
            self._pipe = _Slots(self._allocate(), self._streams)
            if self._ipc:
                self._share_slots()

    @property
    def held_bytes(self) -> int:
        return self._pipe.slots.held_bytes if self._pipe is not None else 0

    def send(self, refit_pass: RefitPass, *, refit_index: int,
             verify: bool = False) -> RefitTelemetry:
        plan, options = self.plan, self._options
        telemetry = RefitTelemetry(
            role="sender", transport=self.transport_name, refit_index=refit_index,
            device=str(self._streams.device), num_tensors=plan.num_tensors,
            num_buffers=plan.num_buffers, payload_bytes=plan.payload_bytes,
            held_bytes=self.held_bytes, checksums=options.checksums)
        start = time.perf_counter()
        self._memory.start()
        switches = self._rounds.start(plan, refit_index=refit_index, checksums=options.checksums,
                                      verify=verify, timeout_s=options.start_timeout_s)
        producer = BufferProducer(
            plan=plan, slots=self._pipe.slots if self._pipe is not None else None,
            refit_pass=refit_pass, rank=self._rank, streams=self._streams,
            checksums=switches.checksums, verify=switches.verify, telemetry=telemetry)
        failure = None
        try:
            failure = self._send_buffers(producer, refit_index=refit_index, telemetry=telemetry)
        except Exception:  # a broken link: still share the outcome, so every rank raises
            failure = f"sending refit {refit_index}: {traceback.format_exc()}"
        failure = producer.finish() or failure
        if switches.verify:
            self._control.all_gather_json(producer.digest_rows(),
                                          what=f"the digests of refit {refit_index}",
                                          timeout_s=options.timeout_s)
        self._rounds.finish(failure, refit_index=refit_index, timeout_s=options.timeout_s)
        telemetry.total_s = time.perf_counter() - start
        telemetry.verified = True if switches.verify else None
        telemetry.record_memory(self._memory.stop())
        return telemetry

    def close(self) -> None:
        for path in self._slot_files:
            path.unlink(missing_ok=True)
        self._slot_files.clear()
        if self._owner is not None:
            self._owner.release()
            self._owner = None
        if self._pipe is not None:
            self._pipe.slots.close()
            self._pipe = None

    # --- internals ------------------------------------------------------------------------

    def _allocate(self) -> BufferSlots:
        if not self._ipc or self._streams.is_cuda:
            return BufferSlots.allocate(self.plan, self._streams.device)
        # CPU with receivers on this "device": shared-memory files they can map.
        directory = private_runtime_dir(self._options.ipc_dir)
        key = f"{self._cpu_device_id}-trainer{self._rank}"
        sweep_stale_files(directory)
        self._owner = claim_owner(directory, key)  # the start-up sweep keeps them while we live
        slots = []
        for index in range(self.plan.num_held_slots):
            path = directory / f"{key}.slot{index}"
            slots.append(create_shared_cpu_slot(path, self.plan.slot_capacity(index)))
            self._slot_files.append(path)
        return BufferSlots(plan=self.plan, slots=slots)

    def _share_slots(self) -> None:
        handles, blobs = [], []
        for index, slot in enumerate(self._pipe.slots.slots):
            cpu_file = self._slot_files[index] if self._slot_files else None
            handle, slot_blobs = describe_slot(slot, cpu_file=cpu_file, first_blob=len(blobs))
            handles.append(to_fields(handle))
            blobs.extend(blob.hex() for blob in slot_blobs)
        for receiver in self._ipc:
            self._control.send_json({"slots": handles, "blobs": blobs},
                                    dst=self._placement.control_rank(receiver), tag=_TAG_SLOTS,
                                    what=f"trainer rank {self._rank}'s slot handles",
                                    timeout_s=self._options.start_timeout_s)

    def _send_buffers(self, producer: BufferProducer, *, refit_index: int,
                      telemetry: RefitTelemetry) -> str | None:
        plan, timeout_s = self.plan, self._options.timeout_s
        pipe = self._pipe
        moving: dict[int, PendingTransfer] = {}  # slot -> its broadcast in flight
        handed: dict[int, list] = {}  # slot -> its buffer's IPC messages in flight
        failure = None
        first = time.perf_counter()
        for buffer in plan.buffers:
            producer.exchange(buffer, timeout_s=timeout_s)
            if buffer.source != self._rank:
                continue
            slot = buffer.slot
            waited = time.perf_counter()
            if slot in moving:
                moving.pop(slot).wait_host(self._streams, timeout_s=timeout_s)
            if slot in handed:
                failure = failure or self._acknowledged(handed.pop(slot))
            telemetry.wait_s += time.perf_counter() - waited
            status = producer.produce(buffer, refit_index=refit_index)
            self._streams.record(pipe.released[slot])
            if self._fanout is not None:
                stream = pipe.streams[slot]
                self._streams.stream_wait(pipe.released[slot], stream)
                moving[slot] = self._fanout.send(
                    buffer, pipe.slots.wire_view(buffer.index), stream=stream,
                    done=pipe.moved[slot],
                    what=f"sending buffer {buffer.index}/{plan.num_buffers} of refit "
                         f"{refit_index} to inference ranks {self._remote} "
                         f"({self._fanout.name})")
            if self._ipc:
                # Another process reads the slot: its bytes must be complete first.
                self._streams.host_wait(pipe.released[slot], timeout_s=timeout_s,
                                        what=f"packing buffer {buffer.index}")
                handed[slot] = [self._hand_over(buffer, receiver, refit_index, status)
                                for receiver in self._ipc]
        for transfer in moving.values():
            transfer.wait_host(self._streams, timeout_s=timeout_s)
        for messages in handed.values():
            failure = failure or self._acknowledged(messages)
        telemetry.transfer_s = time.perf_counter() - first
        return failure

    def _hand_over(self, buffer: PlannedBuffer, receiver: int, refit_index: int,
                   status: BufferStatus) -> tuple:
        """Tell an IPC receiver ``buffer`` is in its slot; its ACK's receive is posted first."""
        peer = self._placement.control_rank(receiver)
        ack = self._control.recv_words(
            2, src=peer, tag=_TAG_ACK,
            what=f"inference rank {receiver}'s ACK of buffer {buffer.index} of refit "
                 f"{refit_index}")
        ready = self._control.send_words(
            [refit_index, buffer.index, int(status)], dst=peer, tag=_TAG_READY,
            what=f"handing buffer {buffer.index} of refit {refit_index} to inference rank "
                 f"{receiver}")
        return buffer, receiver, ready, ack

    def _acknowledged(self, messages: list) -> str | None:
        """Wait for the IPC receivers' ACKs of a buffer; the first failure they report."""
        failure = None
        for buffer, receiver, ready, ack in messages:
            ready.wait(timeout_s=self._options.timeout_s)
            index, ok = ack.wait(timeout_s=self._options.timeout_s)
            if index != buffer.index:
                failure = failure or (f"inference rank {receiver} acknowledged buffer {index}, "
                                      f"expected {buffer.index}")
            elif not ok:
                failure = failure or (f"inference rank {receiver} could not load buffer "
                                      f"{buffer.index} (its own error follows from it)")
        return failure


class BroadcastReceiver(RefitReceiver):
    """Engine end of the non-colocated transport (one per inference rank).

    ``data_groups`` maps each source trainer rank that broadcasts to this rank to its data group;
    sources on this rank's device hand their buffers over IPC instead. ``plan=None`` takes the
    trainers' plan at :meth:`prepare`; a given plan is kept and checked at every refit's start.
    :meth:`prepare` and :meth:`receive` are collectives with the trainer ranks.
    """

    transport_name = "broadcast"

    def __init__(self, *, placement: Placement, receiver: int, control: ControlGroup,
                 data_groups: dict[int, dist.ProcessGroup], device: torch.device,
                 options: TransportOptions, plan: RefitPlan | None = None,
                 links: dict[Link, dist.ProcessGroup] | None = None) -> None:
        self._placement = placement
        self._receiver = receiver
        self._control = control
        self._options = options
        self._streams = DeviceStreams(device, peers=getattr(control, "peers", None))
        self._rounds = RefitRounds(control, name_of=placement.name_of)
        self._data_groups = data_groups
        self._links = links or {}
        self._fanout: BroadcastFanout | RelayFanout | None = None
        self._own_plan = plan
        self._plan: RefitPlan | None = plan
        self._pipe: _Slots | None = None
        self._mapped: dict[int, BufferSlots] = {}  # IPC source -> its slots, mapped here
        self._staging = self._streams.staging(16, torch.int64)
        self._checksum = torch.zeros(1, dtype=torch.int64, device=self._streams.device)
        self._memory = DeviceMemoryProbe(self._streams.device,
                                         track_peak=options.track_peak_memory)

    @property
    def plan(self) -> RefitPlan | None:
        return self._plan

    def prepare(self) -> None:
        """Receive the plan and the IPC sources' slot handles; allocate this rank's slots."""
        timeout_s = self._options.start_timeout_s
        sent = plan_from_json(self._control.broadcast_json(
            None, src=0, what="the refit plan from trainer rank 0", timeout_s=timeout_s))
        plan = self._own_plan if self._own_plan is not None else sent
        self._plan = plan
        check_same_fanout(self._control, self._options, name_of=self._placement.name_of)
        if self._options.fanout == "relay":
            self._fanout = RelayFanout(plan=plan, placement=self._placement,
                                       me=self._placement.control_rank(self._receiver),
                                       links=self._links, streams=self._streams)
        else:
            self._fanout = BroadcastFanout(data_groups=self._data_groups, streams=self._streams)
        for source in plan.sources:
            if self._placement.ipc(source, self._receiver):
                data = self._control.recv_json(src=source, tag=_TAG_SLOTS, timeout_s=timeout_s,
                                               what=f"trainer rank {source}'s slot handles")
                self._mapped[source] = self._map(plan, data)
        remote = [b.index for b in plan.buffers
                  if not self._placement.ipc(b.source, self._receiver)]
        if remote and self._pipe is None:
            self._pipe = _Slots(BufferSlots.allocate(plan, self._streams.device,
                                                     slot_map=_receiver_slots(plan, remote)),
                                self._streams)

    def receive(self, engine: WeightLoader) -> RefitTelemetry:
        assert self._plan is not None, "call prepare() before receive()"
        plan, options = self._plan, self._options
        telemetry = RefitTelemetry(
            role="receiver", transport=self.transport_name, refit_index=-1,
            device=str(self._streams.device), num_tensors=plan.num_tensors,
            num_buffers=plan.num_buffers, payload_bytes=plan.payload_bytes,
            held_bytes=self._pipe.slots.held_bytes if self._pipe is not None else 0)
        start = time.perf_counter()
        self._memory.start()
        # The trainers' refit index and switches come with the start exchange.
        switches = self._rounds.start(plan, refit_index=-1, checksums=False, verify=False,
                                      timeout_s=options.start_timeout_s)
        refit_index = switches.refit_index
        telemetry.refit_index, telemetry.checksums = refit_index, switches.checksums
        failure = None
        try:
            failure = self._receive_buffers(engine, refit_index=refit_index,
                                            checksums=switches.checksums, telemetry=telemetry)
        except Exception:
            failure = f"receiving refit {refit_index}: {traceback.format_exc()}"
        if switches.verify:
            failure = self._verify(engine, failure=failure, telemetry=telemetry,
                                   refit_index=refit_index)
        self._rounds.finish(failure, refit_index=refit_index, timeout_s=options.timeout_s)
        telemetry.total_s = time.perf_counter() - start
        telemetry.record_memory(self._memory.stop())
        return telemetry

    def close(self) -> None:
        self._mapped.clear()
        if self._pipe is not None:
            self._pipe.slots.close()
            self._pipe = None

    # --- internals ------------------------------------------------------------------------

    def _map(self, plan: RefitPlan, data: dict) -> BufferSlots:
        handles = [_message(SlotHandle, handle) for handle in data["slots"]]
        blobs = [bytes.fromhex(blob) for blob in data["blobs"]]
        directory = private_runtime_dir(self._options.ipc_dir)
        slots = [open_slot(handle, blobs, device=self._streams.device, directory=directory)
                 for handle in handles]
        return BufferSlots(plan=plan, slots=slots)

    def _receive_buffers(self, engine: WeightLoader, *, refit_index: int, checksums: bool,
                         telemetry: RefitTelemetry) -> str | None:
        plan, timeout_s = self._plan, self._options.timeout_s
        remote = [b for b in plan.buffers if b.source not in self._mapped]
        posted: dict[int, PendingTransfer] = {}
        # slot -> the forwards (relay) still reading it; on a GPU its stream orders them
        # before the slot's next receive, on the CPU the host waits for them first.
        forwarding: dict[int, list[PendingTransfer]] = {}
        next_post = 0
        occupied: set[int] = set()  # slots holding a posted buffer not yet loaded
        failure = None
        first = time.perf_counter()

        def post_ahead() -> None:
            # Receives are posted in plan order into free slots only; none before the start.
            nonlocal next_post
            while next_post < len(remote):
                buffer = remote[next_post]
                slot = self._pipe.slots.slot_index(buffer.index)
                if slot in occupied:
                    return
                occupied.add(slot)
                if not self._streams.is_cuda:
                    for transfer in forwarding.pop(slot, []):
                        transfer.wait_host(self._streams, timeout_s=timeout_s)
                self._post(buffer, refit_index=refit_index, posted=posted)
                if self._streams.is_cuda:
                    forwarding[slot] = self._forward(buffer, refit_index=refit_index)
                next_post += 1

        for buffer in plan.buffers:
            post_ahead()
            if buffer.source in self._mapped:
                failure = self._take_ipc(buffer, engine, refit_index=refit_index,
                                         checksums=checksums, failure=failure,
                                         telemetry=telemetry) or failure
                continue
            waited = time.perf_counter()
            posted.pop(buffer.index).wait_host(self._streams, timeout_s=timeout_s)
            telemetry.wait_s += time.perf_counter() - waited
            if not self._streams.is_cuda:  # the bytes are here: pass them on
                forwarding[self._pipe.slots.slot_index(buffer.index)] = self._forward(
                    buffer, refit_index=refit_index)
            slots = self._pipe.slots
            problem = self._check(slots, buffer.index, refit_index=refit_index,
                                  checksums=checksums)
            if problem is None and failure is None:
                problem = self._load(engine, slots, buffer.index, telemetry=telemetry)
            failure = failure or problem
            slot = slots.slot_index(buffer.index)
            self._streams.record(self._pipe.released[slot])
            occupied.discard(slot)
        for transfers in forwarding.values():
            for transfer in transfers:
                transfer.wait_host(self._streams, timeout_s=timeout_s)
        self._streams.synchronize(timeout_s=timeout_s, what="loading the last buffer")
        telemetry.transfer_s = time.perf_counter() - first
        return failure

    def _forward(self, buffer: PlannedBuffer, *, refit_index: int) -> list[PendingTransfer]:
        """Pass ``buffer`` on from this rank's slot (relay: this rank is its entry), on the
        slot's stream behind its receive."""
        pipe = self._pipe
        slot = pipe.slots.slot_index(buffer.index)
        return self._fanout.forward(
            buffer, pipe.slots.wire_view(buffer.index), stream=pipe.streams[slot],
            what=f"buffer {buffer.index}/{self._plan.num_buffers} of refit {refit_index}")

    def _post(self, buffer: PlannedBuffer, *, refit_index: int,
              posted: dict[int, PendingTransfer]) -> None:
        pipe = self._pipe
        slot = pipe.slots.slot_index(buffer.index)
        stream = pipe.streams[slot]
        # The slot's stream waits for the last load from it before bytes land in it.
        self._streams.stream_wait(pipe.released[slot], stream)
        posted[buffer.index] = self._fanout.receive(
            buffer, pipe.slots.wire_view(buffer.index), stream=stream, done=pipe.moved[slot],
            what=f"buffer {buffer.index}/{self._plan.num_buffers} of refit {refit_index} from "
                 f"trainer rank {buffer.source} ({self._fanout.name})")

    def _take_ipc(self, buffer: PlannedBuffer, engine: WeightLoader, *, refit_index: int,
                  checksums: bool, failure: str | None, telemetry: RefitTelemetry) -> str | None:
        """Wait for the source's hand-over, load from its slot, ACK (with the outcome)."""
        source = buffer.source
        timeout_s = self._options.timeout_s
        waited = time.perf_counter()
        ready_index, index, _status = self._control.recv_words(
            3, src=source, tag=_TAG_READY,
            what=f"trainer rank {source}'s buffer {buffer.index} of refit {refit_index}").wait(
            timeout_s=timeout_s)
        telemetry.wait_s += time.perf_counter() - waited
        slots = self._mapped[source]
        problem = None
        if (ready_index, index) != (refit_index, buffer.index):
            problem = (f"trainer rank {source} handed over buffer {index} of refit "
                       f"{ready_index}, expected buffer {buffer.index} of refit {refit_index}")
        problem = problem or self._check(slots, buffer.index, refit_index=refit_index,
                                         checksums=checksums)
        if problem is None and failure is None:
            problem = self._load(engine, slots, buffer.index, telemetry=telemetry)
            # The source refills the slot once it has the ACK: finish reading first.
            self._streams.synchronize(timeout_s=timeout_s, what=f"loading buffer {buffer.index}")
        self._control.send_words(
            [buffer.index, int(problem is None and failure is None)], dst=source, tag=_TAG_ACK,
            what=f"the ACK of buffer {buffer.index} to trainer rank {source}").wait(
            timeout_s=timeout_s)
        return problem

    def _check(self, slots: BufferSlots, buffer_index: int, *, refit_index: int,
               checksums: bool) -> str | None:
        """Why the buffer in its slot must not be loaded, or None."""
        self._staging[:8].copy_(slots.header_view(buffer_index), non_blocking=True)
        if checksums:
            buffer_checksum(slots.payload_words(buffer_index), out=self._checksum[0])
            self._staging[8:9].copy_(self._checksum, non_blocking=True)
        self._streams.synchronize(timeout_s=self._options.timeout_s,
                                  what=f"reading the header of buffer {buffer_index}")
        words = self._staging.tolist()
        try:
            header = BufferHeader.from_words(words[:8])
            if header.status == BufferStatus.ABORTED:
                return f"buffer {buffer_index}: its source aborted the refit"
            header.check_expected(plan=self._plan, refit_index=refit_index,
                                  buffer_index=buffer_index)
        except ValueError as error:
            return f"buffer {buffer_index}: {error}"
        if checksums and header.checksum != words[8]:
            names = self._plan.buffer_names(buffer_index)
            return (f"checksum mismatch in buffer {buffer_index}: sent {header.checksum}, "
                    f"received {words[8]} (tensors {names[0]!r} .. {names[-1]!r})")
        return None

    def _load(self, engine: WeightLoader, slots: BufferSlots, buffer_index: int, *,
              telemetry: RefitTelemetry) -> str | None:
        started = time.perf_counter()
        try:
            load_into(engine, slots.entries(buffer_index))
        except Exception:
            return f"engine.load_weights on buffer {buffer_index}: {traceback.format_exc()}"
        finally:
            telemetry.load_s += time.perf_counter() - started
        return None

    def _verify(self, engine: WeightLoader, *, failure: str | None, telemetry: RefitTelemetry,
                refit_index: int) -> str | None:
        started = time.perf_counter()
        plan = self._plan
        shared = self._control.all_gather_json([], what=f"the digests of refit {refit_index}",
                                               timeout_s=self._options.timeout_s)
        table = torch.zeros(plan.num_tensors, DIGEST_WORDS, dtype=torch.int64)
        for index, *digest in (row for rank_rows in shared for row in rank_rows):
            table[index] = torch.tensor(digest, dtype=torch.int64)
        if failure is None:
            failure = verify_engine_weights(engine, plan.specs(), table.to(self._streams.device))
            telemetry.verified = failure is None
        telemetry.verify_s = time.perf_counter() - started
        return failure


def _receiver_slots(plan: RefitPlan, remote: list[int]) -> list[int]:
    """A receiver's slot per buffer: round-robin over the buffers it receives by broadcast
    (oversized ones in the extra slot); buffers it takes over IPC need none."""
    slot_map = [0] * plan.num_buffers
    regular = 0
    for index in remote:
        if plan.buffers[index].oversized:
            slot_map[index] = plan.num_slots
        else:
            slot_map[index] = regular % plan.num_slots
            regular += 1
    return slot_map


def _message(cls, data):
    try:
        return from_fields(cls, data)
    except WireError as error:
        raise RefitError(f"malformed {cls.__name__} on the control plane: {error}") from None
