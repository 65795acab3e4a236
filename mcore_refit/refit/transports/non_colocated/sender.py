"""Non-colocated transport, trainer end: each source rank broadcasts its buffers and hands them
over IPC to an inference rank on its own device (see the package docstring).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mcore_refit.control import ControlGroup
from mcore_refit.refit.buffers import BufferSlots, StreamedSlots
from mcore_refit.refit.config import TransportOptions
from mcore_refit.refit.errors import RefitError, failed
from mcore_refit.refit.plan import RefitPlan
from mcore_refit.refit.producer import BufferProducer
from mcore_refit.refit.source import RefitPass
from mcore_refit.refit.streams import DeviceMemoryProbe, DeviceStreams
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transports.base import RefitSender
from mcore_refit.refit.transports.collectives import PendingTransfer
from mcore_refit.refit.transports.non_colocated.fanout import (
    Link,
    build_fanout,
    check_same_fanout,
)
from mcore_refit.refit.transports.non_colocated.handover import HandedBuffer, HandoverSource
from mcore_refit.refit.transports.non_colocated.placement import Placement
from mcore_refit.refit.transports.rounds import RefitRounds


class NonColocatedSender(RefitSender):
    """Trainer end of the non-colocated transport, on every trainer rank of a non-colocated job.

    ``data_group`` is this rank's own broadcast group (None when it has no remote receivers);
    ``control`` spans every rank of the job. :meth:`prepare` and :meth:`send` are collectives over
    all of them: call them on every rank, in the same order as the receivers.
    """

    transport_name = "non_colocated"

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
        self._remote = placement.remote_receivers(rank) if rank in plan.sources else []
        self._fanout = None
        if self._remote:
            if options.fanout == "broadcast" and data_group is None:
                raise ValueError(f"trainer rank {rank} sends to inference ranks {self._remote} "
                                 "but has no data group")
            self._fanout = build_fanout(options.fanout, plan=plan, placement=placement, me=rank,
                                        data_groups={rank: data_group}, links=links or {},
                                        streams=self._streams)
        ipc = placement.ipc_receivers(rank) if rank in plan.sources else []
        self._handover = (HandoverSource(control=control, placement=placement, rank=rank,
                                         receivers=ipc, options=options,
                                         cpu_device_id=cpu_device_id) if ipc else None)
        self._pipe: StreamedSlots | None = None
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
            if self._handover is not None:
                slots = self._handover.allocate(self.plan, self._streams.device)
                self._handover.share(slots)
            else:
                slots = BufferSlots.allocate(self.plan, self._streams.device)
            self._pipe = StreamedSlots(slots, self._streams)

    @property
    def held_bytes(self) -> int:
        return self._pipe.slots.held_bytes if self._pipe is not None else 0

    def send(self, refit_pass: RefitPass, *, refit_index: int,
             verify: bool = False) -> RefitTelemetry:
        plan, options = self.plan, self._options
        telemetry = RefitTelemetry.for_plan(
            plan, role="sender", transport=self.transport_name, refit_index=refit_index,
            device=self._streams.device, held_bytes=self.held_bytes, checksums=options.checksums)
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
        except Exception as error:  # a broken link: still share the outcome, so every rank raises
            failure = failed(f"sending refit {refit_index}", error)
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
        if self._handover is not None:
            self._handover.close()
        if self._pipe is not None:
            self._pipe.slots.close()
            self._pipe = None

    # --- internals ------------------------------------------------------------------------

    def _send_buffers(self, producer: BufferProducer, *, refit_index: int,
                      telemetry: RefitTelemetry) -> RefitError | None:
        plan, timeout_s = self.plan, self._options.timeout_s
        pipe = self._pipe
        moving: dict[int, PendingTransfer] = {}  # slot -> its send in flight
        handed: dict[int, list[HandedBuffer]] = {}  # slot -> its buffer's IPC hand-overs
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
                failure = failure or self._handover.acknowledged(handed.pop(slot))
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
            if self._handover is not None:
                # Another process reads the slot: its bytes must be complete first.
                self._streams.host_wait(pipe.released[slot], timeout_s=timeout_s,
                                        what=f"packing buffer {buffer.index}")
                handed[slot] = self._handover.hand_over(buffer, refit_index=refit_index,
                                                        status=status)
        for transfer in moving.values():
            transfer.wait_host(self._streams, timeout_s=timeout_s)
        for messages in handed.values():
            failure = failure or self._handover.acknowledged(messages)
        telemetry.transfer_s = time.perf_counter() - first
        return failure
