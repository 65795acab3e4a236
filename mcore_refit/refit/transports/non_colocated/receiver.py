"""Non-colocated transport, inference end: receives each buffer by broadcast from its source, or
loads it from the slots of a source on its own device (see the package docstring).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mcore_refit.control import ControlGroup
from mcore_refit.refit.buffers import BufferSlots, StreamedSlots, check_buffer
from mcore_refit.refit.checksum import buffer_checksum, digest_table, verify_engine_weights
from mcore_refit.refit.config import TransportOptions
from mcore_refit.refit.engines import WeightLoader, load_into
from mcore_refit.refit.errors import RefitError, failed
from mcore_refit.refit.plan import PlannedBuffer, RefitPlan, plan_from_json
from mcore_refit.refit.streams import DeviceMemoryProbe, DeviceStreams
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transports.base import RefitReceiver
from mcore_refit.refit.transports.collectives import PendingTransfer
from mcore_refit.refit.transports.non_colocated.fanout import (
    AnyFanout,
    Link,
    build_fanout,
    check_same_fanout,
)
from mcore_refit.refit.transports.non_colocated.handover import HandoverTarget
from mcore_refit.refit.transports.non_colocated.placement import Placement
from mcore_refit.refit.transports.rounds import RefitRounds

# Receives posted ahead of the buffer being loaded when the plan gives every buffer its own slot
# (then free slots no longer bound them). All 16 of the 8B preset posted at once, each broadcast
# on its slot's stream beside vLLM's loads, made its refit slower on 2 x H200 (145-154 ms against
# 105-117 ms with two slots); two ahead, 105-131 ms (docs/benchmarks.md, "A slot for every
# buffer").
HELD_POSTED_AHEAD = 2


class NonColocatedReceiver(RefitReceiver):
    """Engine end of the non-colocated transport (one per inference rank).

    ``data_groups`` maps each source trainer rank that broadcasts to this rank to its data group;
    sources on this rank's device hand their buffers over IPC instead. ``plan=None`` takes the
    trainers' plan at :meth:`prepare`; a given plan is kept and checked at every refit's start.
    :meth:`prepare` and :meth:`receive` are collectives with the trainer ranks.
    """

    transport_name = "non_colocated"

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
        self._fanout: AnyFanout | None = None
        self._own_plan = plan
        self._plan: RefitPlan | None = plan
        self._pipe: StreamedSlots | None = None
        self._handover = HandoverTarget(control=control, device=self._streams.device,
                                        options=options)
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
        self._fanout = build_fanout(self._options.fanout, plan=plan, placement=self._placement,
                                    me=self._placement.control_rank(self._receiver),
                                    data_groups=self._data_groups, links=self._links,
                                    streams=self._streams)
        for source in plan.sources:
            if self._placement.ipc(source, self._receiver):
                self._mapped[source] = self._handover.map(plan, source=source)
        remote = [b.index for b in plan.buffers
                  if not self._placement.ipc(b.source, self._receiver)]
        if remote and self._pipe is None:
            self._pipe = StreamedSlots(BufferSlots.allocate(plan, self._streams.device,
                                                            slot_map=_receiver_slots(plan, remote)),
                                       self._streams)

    def receive(self, engine: WeightLoader) -> RefitTelemetry:
        assert self._plan is not None, "call prepare() before receive()"
        plan, options = self._plan, self._options
        telemetry = RefitTelemetry.for_plan(
            plan, role="receiver", transport=self.transport_name, refit_index=-1,
            device=self._streams.device,
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
        except Exception as error:
            failure = failed(f"receiving refit {refit_index}", error)
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

    def _receive_buffers(self, engine: WeightLoader, *, refit_index: int, checksums: bool,
                         telemetry: RefitTelemetry) -> RefitError | None:
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

        # With a slot for every buffer, free slots no longer bound the receives posted ahead.
        ahead = min(plan.num_slots, HELD_POSTED_AHEAD) if plan.slot_per_buffer else len(remote)

        def post_ahead() -> None:
            # Receives are posted in plan order into free slots only; none before the start.
            nonlocal next_post
            while next_post < len(remote) and len(posted) < ahead:
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
            try:
                self._check(slots, buffer.index, refit_index=refit_index, checksums=checksums)
                if failure is None:
                    self._load(engine, slots, buffer.index, telemetry=telemetry)
            except RefitError as error:
                failure = failure or error
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
                  checksums: bool, failure: RefitError | None,
                  telemetry: RefitTelemetry) -> RefitError | None:
        """Wait for the source's hand-over, load from its slot, ACK (with the outcome); this
        buffer's problem, if any."""
        waited = time.perf_counter()
        problem = self._handover.wait_ready(buffer, refit_index=refit_index)
        telemetry.wait_s += time.perf_counter() - waited
        slots = self._mapped[buffer.source]
        try:
            if problem is None:
                self._check(slots, buffer.index, refit_index=refit_index, checksums=checksums)
            if problem is None and failure is None:
                self._load(engine, slots, buffer.index, telemetry=telemetry)
                # The source refills the slot once it has the ACK: finish reading first.
                self._streams.synchronize(timeout_s=self._options.timeout_s,
                                          what=f"loading buffer {buffer.index}")
        except RefitError as error:
            problem = error
        self._handover.acknowledge(buffer, ok=problem is None and failure is None)
        return problem

    def _check(self, slots: BufferSlots, buffer_index: int, *, refit_index: int,
               checksums: bool) -> None:
        """Raise :class:`RefitError` if the buffer in its slot must not be loaded."""
        self._staging[:8].copy_(slots.header_view(buffer_index), non_blocking=True)
        if checksums:
            buffer_checksum(slots.payload_words(buffer_index), out=self._checksum[0])
            self._staging[8:9].copy_(self._checksum, non_blocking=True)
        self._streams.synchronize(timeout_s=self._options.timeout_s,
                                  what=f"reading the header of buffer {buffer_index}")
        words = self._staging.tolist()
        check_buffer(words[:8], plan=self._plan, buffer_index=buffer_index,
                     refit_index=refit_index, checksum=words[8] if checksums else None)

    def _load(self, engine: WeightLoader, slots: BufferSlots, buffer_index: int, *,
              telemetry: RefitTelemetry) -> None:
        started = time.perf_counter()
        try:
            load_into(engine, slots.entries(buffer_index), held=self._plan.slot_per_buffer)
        except Exception as error:
            raise failed(f"engine.load_weights on buffer {buffer_index}", error) from error
        finally:
            telemetry.load_s += time.perf_counter() - started

    def _verify(self, engine: WeightLoader, *, failure: RefitError | None,
                telemetry: RefitTelemetry, refit_index: int) -> RefitError | None:
        started = time.perf_counter()
        plan = self._plan
        shared = self._control.all_gather_json([], what=f"the digests of refit {refit_index}",
                                               timeout_s=self._options.timeout_s)
        if failure is None:
            table = digest_table(shared, num_tensors=plan.num_tensors)
            mismatch = verify_engine_weights(engine, plan.specs(),
                                             table.to(self._streams.device))
            telemetry.verified = mismatch is None
            if mismatch is not None:
                failure = RefitError(mismatch)
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
