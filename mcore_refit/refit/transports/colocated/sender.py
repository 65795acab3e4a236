"""Colocated transport, trainer end: buffers shared with the engine process through CUDA IPC.

The trainer binds a ZMQ DEALER socket at ``ipc://<private dir>/<GPU UUID>.sock``; the engine
process connects a REP socket (:mod:`.receiver`), which answers requests one at a time, in
order. Every request carries an id that its reply echoes (the REP envelope), so the trainer may
have several requests outstanding and drops replies to requests it gave up on. Messages
(:mod:`..wire`; every request gets exactly one reply):

- :class:`~.wire.Hello` (plan, slot handles) → ``Ready``: once per engine connection; the engine
  maps the slots once and reuses them for every refit;
- :class:`~.wire.Start` (refit index, plan fingerprint, switches) → ``Started``;
- :class:`~.wire.BufferReady` → :class:`~.wire.Ack`: the engine checks the in-slot header (and
  checksum), loads views into the slot, synchronises, then ACKs; only then may the trainer refill
  that slot. The trainer announces each buffer as soon as it is in its slot, without waiting for
  the previous buffer's ACK, so the engine finds the next message queued when it finishes a
  load. A failed load's ACK carries the traceback, which raises on the trainer;
- :class:`~.wire.Complete` (optional digests) → :class:`~.wire.Summary`: every planned tensor
  loaded exactly once, digests equal.

With several trainer ranks (``trainers``, each with its own engine that holds the whole model),
each buffer first moves from its source rank to every trainer rank as one broadcast over
``trainers`` (the source's export filled it), then over IPC into this rank's engine: every trainer
rank takes part in every buffer's broadcast, in plan order, so a rank that failed keeps taking
part and raises once the refit's buffers are through. With two slots the trainer fills buffer
k+1 while the engine loads buffer k. Every wait has a timeout naming what it waited for. On CPU
the slots are shared-memory files, so the same protocol runs in tests without a GPU.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import zmq

from mcore_refit.control import ControlGroup
from mcore_refit.refit.buffers import BufferSlots, BufferStatus, HeaderWord
from mcore_refit.refit.checksum import digest_table
from mcore_refit.refit.config import TransportOptions
from mcore_refit.refit.errors import RefitError, RefitTimeout
from mcore_refit.refit.plan import PlannedBuffer, RefitPlan
from mcore_refit.refit.producer import BufferProducer
from mcore_refit.refit.source import RefitPass
from mcore_refit.refit.streams import DeviceMemoryProbe, DeviceStreams
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transports.base import RefitSender
from mcore_refit.refit.transports.collectives import GroupCollectives
from mcore_refit.refit.transports.ipc_files import (
    address_of,
    claim_owner,
    claim_socket_path,
    create_shared_cpu_slot,
    describe_slot,
    device_key,
    private_runtime_dir,
    socket_path,
    sweep_stale_files,
)
from mcore_refit.refit.transports.wire import (
    Ack,
    BufferReady,
    Complete,
    Error,
    Hello,
    Message,
    Ready,
    Start,
    Started,
    Summary,
    WireError,
    decode,
    encode,
)


class ColocatedSender(RefitSender):
    """Trainer end of the colocated transport. Binds the socket at construction.

    ``cpu_device_id`` names the device on CPU (tests, demos); on GPU the UUID is used.
    :attr:`address` is what the engine process connects to. ``trainers`` is a group over the
    trainer ranks when several of them hold parts of the model (``rank``: this rank in it), and
    ``control`` a gloo group over them. ``peer_alive()`` says what happened to the engine process
    once it is gone (None while it lives): waits on the engine check it every
    ``options.liveness_s``.
    """

    transport_name = "colocated"

    def __init__(self, *, plan: RefitPlan, device: torch.device, options: TransportOptions,
                 cpu_device_id: str | None = None, trainers: dist.ProcessGroup | None = None,
                 control: ControlGroup | None = None, rank: int = 0,
                 peer_alive: Callable[[], str | None] | None = None) -> None:
        super().__init__(plan=plan)
        self._options = options
        self._peer_alive = peer_alive
        self._streams = DeviceStreams(device)
        self._rank = rank
        self._trainers = (GroupCollectives(group=trainers, streams=self._streams)
                          if trainers is not None and trainers.size() > 1 else None)
        self._control = control
        if self._trainers is None and set(plan.sources) != {rank}:
            raise ValueError(f"the plan's buffers come from ranks {list(plan.sources)} but no "
                             "group over the trainer ranks was given to move them")
        if self._trainers is not None and control is None:
            raise ValueError("several trainer ranks need a control group to share outcomes")
        self._key = device_key(self._streams.device, cpu_device_id=cpu_device_id)
        self._dir = private_runtime_dir(options.ipc_dir)
        self._socket_path = socket_path(self._dir, self._key)
        # Files of jobs that died (SIGKILL leaves them) go first; ours are recorded as ours.
        sweep_stale_files(self._dir)
        self._owner = claim_owner(self._dir, self._key)
        try:
            claim_socket_path(self._socket_path)
            self.address = address_of(self._socket_path)
            self._context = zmq.Context()
            self._socket = self._context.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._request_ids = itertools.count()
            self._socket.bind(self.address)
        except BaseException:
            self._owner.release()
            raise
        self._slot_files: list[Path] = []
        self._slots: BufferSlots | None = None
        self._hello: Hello | None = None
        self._engine_ready = False
        self._memory = DeviceMemoryProbe(self._streams.device,
                                         track_peak=options.track_peak_memory)
        self._filled = [self._streams.new_event() for _ in range(plan.num_held_slots)]

    def prepare(self) -> None:
        """Allocate the slots and their IPC handles (once); the engine maps them on first use."""
        if self._slots is not None:
            return
        handles, blobs, slots = [], [], []
        for index in range(self.plan.num_held_slots):
            nbytes = self.plan.slot_capacity(index)
            cpu_file = None
            if self._streams.is_cuda:
                slot = torch.zeros(nbytes, dtype=torch.uint8, device=self._streams.device)
            else:
                cpu_file = self._dir / f"{self._key}.slot{index}"
                slot = create_shared_cpu_slot(cpu_file, nbytes)
                self._slot_files.append(cpu_file)
            handle, slot_blobs = describe_slot(slot, cpu_file=cpu_file, first_blob=len(blobs))
            handles.append(handle)
            blobs.extend(slot_blobs)
            slots.append(slot)
        # Every buffer passes through this rank's slots: use the receivers' slot numbering.
        self._slots = BufferSlots(plan=self.plan, slots=slots, all_buffers=True)
        self._hello = Hello(plan=self.plan.to_json(), device_key=self._key, slots=tuple(handles),
                            blobs=tuple(blobs))

    @property
    def held_bytes(self) -> int:
        return self._slots.held_bytes if self._slots is not None else 0

    def send(self, refit_pass: RefitPass, *, refit_index: int,
             verify: bool = False) -> RefitTelemetry:
        assert self._slots is not None, "call prepare() before send()"
        plan, options = self.plan, self._options
        telemetry = RefitTelemetry.for_plan(
            plan, role="sender", transport=self.transport_name, refit_index=refit_index,
            device=self._streams.device, held_bytes=self._slots.held_bytes,
            checksums=options.checksums)
        start = time.perf_counter()
        self._memory.start()
        producer = BufferProducer(plan=plan, slots=self._slots, refit_pass=refit_pass,
                                  rank=self._rank, streams=self._streams,
                                  checksums=options.checksums, verify=verify,
                                  telemetry=telemetry)
        engine_failure: BaseException | None = None
        try:
            self._start(refit_index=refit_index, verify=verify)
        except RefitError as error:
            engine_failure = error
        # A buffer arrived aborted: the engine gets no more.
        source_failure: RefitError | None = None
        # Announced to the engine, ACK not yet received (oldest first; ACKs come in order).
        unacked: deque[tuple[PlannedBuffer, bytes]] = deque()
        first_send = None
        for buffer in plan.buffers:
            # The engine may still be reading the buffer that last used this slot.
            while (engine_failure is None and unacked
                   and any(b.receiver_slot == buffer.receiver_slot for b, _ in unacked)):
                engine_failure = self._await_ack(*unacked.popleft(), refit_index, telemetry)
            aborted = self._fill(buffer, producer, refit_index=refit_index)
            if aborted and source_failure is None:
                source_failure = RefitError(f"trainer rank {buffer.source} aborted buffer "
                                            f"{buffer.index} (its export failed)")
            if engine_failure is not None or source_failure is not None:
                continue
            first_send = first_send if first_send is not None else time.perf_counter()
            try:
                request = self._send(BufferReady(refit_index=refit_index,
                                                 buffer_index=buffer.index),
                                     what=f"buffer {buffer.index}/{plan.num_buffers} of refit "
                                          f"{refit_index}")
                unacked.append((buffer, request))
            except RefitError as error:
                engine_failure = error
        while engine_failure is None and unacked:
            engine_failure = self._await_ack(*unacked.popleft(), refit_index, telemetry)
        failure = producer.finish() or source_failure
        if first_send is not None:
            telemetry.transfer_s = time.perf_counter() - first_send
        digests = self._digest_table(producer) if verify else None
        return self._finish(refit_index=refit_index, failure=failure,
                            engine_failure=engine_failure, digests=digests, verify=verify,
                            telemetry=telemetry, started=start)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._context.term()
            self._socket = None
        self._socket_path.unlink(missing_ok=True)
        for path in self._slot_files:
            path.unlink(missing_ok=True)
        self._slot_files.clear()
        self._owner.release()
        if self._slots is not None:
            self._slots.close()
            self._slots = None
            if self._streams.is_cuda:
                torch.cuda.ipc_collect()

    # --- steps ----------------------------------------------------------------------------

    def _fill(self, buffer: PlannedBuffer, producer: BufferProducer, *, refit_index: int) -> bool:
        """Put ``buffer``'s bytes in its slot: packed here or broadcast from its source rank;
        returns once they are in memory (the engine reads them from another process), and
        whether the source aborted the buffer."""
        timeout_s = self._options.timeout_s
        producer.exchange(buffer, timeout_s=timeout_s)
        if buffer.source == self._rank:
            producer.produce(buffer, refit_index=refit_index)
        if self._trainers is not None:
            self._trainers.broadcast_async(
                self._slots.wire_view(buffer.index), src_rank=buffer.source,
                what=f"buffer {buffer.index} of refit {refit_index} from trainer rank "
                     f"{buffer.source}").wait_stream(self._streams, timeout_s=timeout_s)
        done = self._filled[self._slots.slot_index(buffer.index)]
        self._streams.record(done)
        self._streams.host_wait(done, timeout_s=timeout_s,
                                what=f"buffer {buffer.index} of refit {refit_index} in its slot")
        status = int(self._slots.header_view(buffer.index)[HeaderWord.STATUS].item())
        return status == BufferStatus.ABORTED

    def _digest_table(self, producer: BufferProducer) -> torch.Tensor:
        """The digests of every tensor as its source exported it (from every source rank)."""
        rows = producer.digest_rows()
        shared = ([rows] if self._control is None else
                  self._control.all_gather_json(rows, what="the trainer ranks' digests"))
        return digest_table(shared, num_tensors=self.plan.num_tensors)

    def _start(self, *, refit_index: int, verify: bool) -> Started:
        start = Start(refit_index=refit_index, fingerprint=self.plan.fingerprint,
                      checksums=self._options.checksums, verify=verify)
        timeout_s = self._options.start_timeout_s
        what = f"the engine's reply to the start of refit {refit_index}"
        if not self._engine_ready:
            self._request(self._hello, Ready, timeout_s=timeout_s,
                          what="the engine's reply to hello (mapping the buffers)")
            self._engine_ready = True
        reply = self._request(start, Started, timeout_s=timeout_s, what=what, refusal=True)
        if isinstance(reply, Error) and reply.need_hello:
            # The engine process restarted since our hello: introduce ourselves again.
            self._request(self._hello, Ready, timeout_s=timeout_s,
                          what="the engine's reply to hello (mapping the buffers)")
            reply = self._request(start, Started, timeout_s=timeout_s, what=what, refusal=True)
        if isinstance(reply, Error):
            raise RefitError(f"the engine refused refit {refit_index}: {reply.message}")
        return reply

    def _await_ack(self, buffer: PlannedBuffer, request: bytes, refit_index: int,
                   telemetry: RefitTelemetry) -> RefitError | None:
        """The engine's ACK of ``buffer`` (announced as ``request``); the error it reports (or
        the wait's), else None. After an error the engine reads no more of this refit's
        announcements; their replies, if any, are dropped as stale."""
        waited = time.perf_counter()
        names = self.plan.buffer_names(buffer.index)
        what = (f"the engine's ACK of buffer {buffer.index}/{self.plan.num_buffers} of refit "
                f"{refit_index}")
        try:
            reply = self._receive(Ack, request, timeout_s=self._options.timeout_s, what=what)
        except RefitError as error:
            return error
        finally:
            telemetry.wait_s += time.perf_counter() - waited
        if not reply.ok:
            return RefitError(f"the engine failed on buffer {buffer.index} of refit {refit_index} "
                              f"(tensors {names[0]!r} .. {names[-1]!r}): {reply.message}")
        if reply.buffer_index != buffer.index:
            return RefitError(f"the engine acknowledged buffer {reply.buffer_index}, expected "
                              f"{buffer.index}")
        return None

    def _finish(self, *, refit_index: int, failure: RefitError | None,
                engine_failure: RefitError | None, digests: torch.Tensor | None, verify: bool,
                telemetry: RefitTelemetry, started: float) -> RefitTelemetry:
        """End the refit on the engine (unless the engine already failed) and raise the
        trainer's failure first, then the engine's; the telemetry when both succeeded."""
        if engine_failure is None:
            engine_failure = self._complete(refit_index=refit_index, failure=failure,
                                            digests=digests, telemetry=telemetry)
        if failure is not None:
            raise RefitError(f"refit {refit_index} failed on trainer rank {self._rank}: "
                             f"{failure}") from failure
        if engine_failure is not None:
            raise engine_failure
        telemetry.total_s = time.perf_counter() - started
        telemetry.verified = True if verify else None
        telemetry.record_memory(self._memory.stop())
        return telemetry

    def _complete(self, *, refit_index: int, failure: RefitError | None,
                  digests: torch.Tensor | None, telemetry: RefitTelemetry) -> RefitError | None:
        """Tell the engine the refit's buffers are through (or why it is aborted)."""
        blobs = (digests.numpy().tobytes(),) if digests is not None and failure is None else ()
        what = f"the engine's summary of refit {refit_index}"
        try:
            aborted = str(failure) if failure is not None else None
            reply = self._request(Complete(refit_index=refit_index, aborted=aborted,
                                           blobs=blobs), Summary,
                                  timeout_s=self._options.timeout_s, what=what)
        except RefitError as error:
            return None if failure is not None else error
        if failure is None and not reply.ok:
            return RefitError(f"refit {refit_index} incomplete on the engine: {reply.message}")
        return None

    # --- socket ---------------------------------------------------------------------------

    def _request(self, message: Message, expect: type[Message], *, timeout_s: float, what: str,
                 refusal: bool = False) -> Message:
        request = self._send(message, what=message.KIND)
        return self._receive(expect, request, timeout_s=timeout_s, what=what, refusal=refusal)

    def _send(self, message: Message, *, what: str) -> bytes:
        """Send ``message`` as a new request; its id, which the reply echoes."""
        timeout_s = (self._options.start_timeout_s if isinstance(message, Hello)
                     else self._options.timeout_s)
        if not self._poll(zmq.POLLOUT, timeout_s=timeout_s, what=f"the engine to take {what}"):
            self._engine_ready = False
            raise RefitTimeout(f"timed out after {timeout_s:g} s waiting to send {what} to the "
                               f"engine at {self.address}: no engine process is connected")
        request = next(self._request_ids).to_bytes(8, "little")
        # [id, empty delimiter, message]: the REP socket's envelope, echoed in the reply.
        self._socket.send_multipart([request, b"", *encode(message)], copy=False)
        return request

    def _receive(self, expect: type[Message], request: bytes, *, timeout_s: float, what: str,
                 refusal: bool = False) -> Message:
        """The engine's reply to ``request``: of type ``expect``, or an :class:`Error` when
        ``refusal``. Replies to earlier requests (ones given up on) are dropped."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._poll(zmq.POLLIN, timeout_s=max(0.0, deadline - time.monotonic()),
                              what=what):
                self._engine_ready = False
                raise RefitTimeout(f"timed out after {timeout_s:g} s waiting for {what} at "
                                   f"{self.address}; is the engine process alive?")
            frames = self._socket.recv_multipart()
            if len(frames) >= 2 and frames[0] == request and frames[1] == b"":
                break
        try:
            reply = decode(frames[2:])
        except WireError as error:
            self._engine_ready = False
            raise RefitError(f"invalid reply while waiting for {what}: {error}") from None
        if isinstance(reply, expect) or (refusal and isinstance(reply, Error)):
            return reply
        if isinstance(reply, Error):
            raise RefitError(f"the engine replied with an error to {what}: {reply.message}")
        raise RefitError(f"expected {expect.KIND} for {what}, got {reply.KIND}")

    def _poll(self, event: int, *, timeout_s: float, what: str) -> bool:
        """Wait up to ``timeout_s`` for ``event`` on the socket, checking every
        ``options.liveness_s`` that the engine process lives (:class:`RefitError` naming what
        happened to it, if not)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            step = left if self._peer_alive is None else min(left, self._options.liveness_s)
            if self._socket.poll(max(0, int(step * 1000)), event):
                return True
            if self._peer_alive is not None:
                problem = self._peer_alive()
                if problem is not None:
                    self._engine_ready = False
                    raise RefitError(f"{problem} while the trainer waited for {what}")
            if time.monotonic() >= deadline:
                return False
