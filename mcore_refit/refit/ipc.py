"""Colocated transport: ZMQ REQ/REP control messages, buffers shared through CUDA IPC.

The trainer binds a REQ socket at ``ipc://<private dir>/<GPU UUID>.sock``; the engine process
connects a REP socket. Messages (see :mod:`.wire`; every request gets exactly one reply):

- ``hello`` (plan, slot handles) → ``ready``: sent once per engine connection; the engine maps
  the slots once and reuses them for every refit;
- ``start`` (refit index, plan fingerprint, switches) → ``started``: checks the plan;
- ``buffer`` (refit index, buffer index, names, used bytes, checksum) → ``ack``: the engine
  checks, unpacks views, ``load_weights``, synchronises, then ACKs: only then may the trainer
  refill that slot. The ACK carries the traceback when loading failed, which raises on the trainer;
- ``complete`` (optional weight digests) → ``summary``: every planned tensor loaded exactly once,
  digests equal; ``error`` replies to anything malformed or out of order.

With two slots the trainer exports and packs buffer k+1 while the engine loads buffer k; with one
slot nothing overlaps. Every wait on either side has a timeout naming what it waited for; a dead
engine is a :class:`~mcore_refit.refit.transport.RefitTimeout` on the trainer. On CPU the slots are
shared-memory files, so the same protocol runs in tests without a GPU.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from mcore_refit.refit.buffers import BufferHeader, BufferSlots, BufferStatus, SourceReader
from mcore_refit.refit.checksum import DigestRecorder, buffer_checksum, verify_engine_weights
from mcore_refit.refit.config import RefitConfig
from mcore_refit.refit.ipc_memory import (
    address_of,
    claim_socket_path,
    create_shared_cpu_slot,
    describe_slot,
    device_key,
    gpu_uuid,
    open_slot,
    path_of,
    private_runtime_dir,
    socket_path,
)
from mcore_refit.refit.plan import RefitPlan, plan_from_json
from mcore_refit.refit.streams import DeviceMemoryProbe, DeviceStreams
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transport import (
    RefitError,
    RefitReceiver,
    RefitSender,
    RefitTimeout,
    WeightLoader,
)
from mcore_refit.refit.wire import Message, WireError, decode, encode

_MAX_NAMES_SHOWN = 10


class IpcSender(RefitSender):
    """Trainer end of the colocated transport. Binds the socket at construction.

    ``cpu_device_id`` names the device on CPU (tests, demos); on GPU the UUID is used.
    :attr:`address` is what the engine process connects to.
    """

    transport_name = "ipc"

    def __init__(self, *, plan: RefitPlan, device: torch.device, config: RefitConfig,
                 cpu_device_id: str | None = None) -> None:
        super().__init__(plan=plan)
        self._config = config
        self._streams = DeviceStreams(device)
        self._key = device_key(self._streams.device, cpu_device_id=cpu_device_id)
        self._dir = private_runtime_dir(config.ipc_dir)
        self._socket_path = socket_path(self._dir, self._key)
        claim_socket_path(self._socket_path)
        self.address = address_of(self._socket_path)
        assert self.address == self.address_for(device=device, config=config,
                                                cpu_device_id=cpu_device_id)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REQ)
        # RELAXED: a new request may follow a timed-out one; CORRELATE: late replies to the
        # timed-out request are dropped instead of being taken for the next reply.
        self._socket.setsockopt(zmq.REQ_RELAXED, 1)
        self._socket.setsockopt(zmq.REQ_CORRELATE, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)
        self._slot_files: list[Path] = []
        self._slots: BufferSlots | None = None
        self._hello: Message | None = None
        self._engine_ready = False
        self._memory = DeviceMemoryProbe(self._streams.device,
                                         track_peak=config.track_peak_memory)
        self._pack_events = [self._streams.new_event(timing=True) for _ in range(2)]

    @staticmethod
    def address_for(*, device: torch.device, config: RefitConfig,
                    cpu_device_id: str | None = None) -> str:
        """The address a sender for ``device`` binds (to start the engine before the sender)."""
        key = device_key(torch.device(device), cpu_device_id=cpu_device_id)
        return address_of(socket_path(private_runtime_dir(config.ipc_dir), key))

    def prepare(self) -> None:
        """Allocate the slots and their IPC handles (once); the engine maps them on first use."""
        if self._slots is not None:
            return
        slot_fields, blobs, slots = [], [], []
        for index in range(self.plan.num_slots_total):
            nbytes = self.plan.slot_bytes(index)
            cpu_file = None
            if self._streams.is_cuda:
                slot = torch.zeros(nbytes, dtype=torch.uint8, device=self._streams.device)
            else:
                cpu_file = self._dir / f"{self._key}.slot{index}"
                slot = create_shared_cpu_slot(cpu_file, nbytes)
                self._slot_files.append(cpu_file)
            fields, slot_blobs = describe_slot(slot, cpu_file=cpu_file)
            fields["first_blob"], fields["num_blobs"] = len(blobs), len(slot_blobs)
            slot_fields.append(fields)
            blobs.extend(slot_blobs)
            slots.append(slot)
        self._slots = BufferSlots(plan=self.plan, slots=slots)
        self._hello = Message(kind="hello", fields={
            "plan": self.plan.to_json(), "device_key": self._key, "slots": slot_fields,
        }, blobs=tuple(blobs))

    def send(self, weights, *, refit_index: int, verify: bool = False,
             stable_tensors: bool = False) -> RefitTelemetry:
        assert self._slots is not None, "call prepare() before send()"
        plan, config = self.plan, self._config
        telemetry = RefitTelemetry(
            role="sender", transport=self.transport_name, refit_index=refit_index,
            device=str(self._streams.device), num_tensors=plan.num_tensors,
            num_buffers=plan.num_buffers, bytes=plan.total_bytes,
            buffer_bytes=self._slots.held_bytes, checksums=config.checksums)
        start = time.perf_counter()
        self._memory.start()
        reader = SourceReader(plan, weights)
        digests = DigestRecorder(self._streams.device) if verify else None
        try:
            self._start(refit_index=refit_index, verify=verify)
            self._send_buffers(reader, refit_index=refit_index, digests=digests,
                               batched=stable_tensors, telemetry=telemetry)
            self._complete(refit_index=refit_index, digests=digests, telemetry=telemetry)
        except BaseException:
            reader.drain()
            raise
        telemetry.total_s = time.perf_counter() - start
        telemetry.verified = True if verify else None
        telemetry.record_memory(self._memory.stop())
        return telemetry

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._context.term()
            self._socket = None
        self._socket_path.unlink(missing_ok=True)
        for path in self._slot_files:
            path.unlink(missing_ok=True)
        self._slot_files.clear()
        if self._slots is not None:
            self._slots.close()
            self._slots = None
            if self._streams.is_cuda:
                torch.cuda.ipc_collect()

    # --- protocol steps --------------------------------------------------------------------

    def _start(self, *, refit_index: int, verify: bool) -> None:
        start = Message(kind="start", fields={
            "refit_index": refit_index, "fingerprint": self.plan.fingerprint,
            "checksums": self._config.checksums, "verify": verify,
        })
        timeout_s = self._config.start_timeout_s
        if not self._engine_ready:
            self._request(self._hello, expect="ready", timeout_s=timeout_s,
                          what="the engine's reply to hello (mapping the buffers)")
            self._engine_ready = True
        reply = self._request(start, expect=("started", "error"), timeout_s=timeout_s,
                              what=f"the engine's reply to the start of refit {refit_index}")
        if reply.kind == "error" and reply.fields.get("need_hello") is True:
            # The engine process restarted since our hello: introduce ourselves again.
            self._request(self._hello, expect="ready", timeout_s=timeout_s,
                          what="the engine's reply to hello (mapping the buffers)")
            reply = self._request(start, expect=("started", "error"), timeout_s=timeout_s,
                                  what=f"the engine's reply to the start of refit {refit_index}")
        if reply.kind == "error":
            raise RefitError(f"the engine refused refit {refit_index}: "
                             f"{reply.fields.get('message')}")

    def _send_buffers(self, reader: SourceReader, *, refit_index: int,
                      digests: DigestRecorder | None, batched: bool,
                      telemetry: RefitTelemetry) -> None:
        plan = self.plan
        in_flight: int | None = None  # buffer sent, ACK not yet received
        first_send = None
        for buffer in plan.buffers:
            if in_flight is not None and plan.buffers[in_flight].slot == buffer.slot:
                self._await_ack(in_flight, refit_index=refit_index, telemetry=telemetry)
                in_flight = None
            try:
                checksum = self._pack(buffer.index, reader, refit_index=refit_index,
                                      digests=digests, batched=batched, telemetry=telemetry)
            except Exception as error:
                if isinstance(error, RefitError):
                    raise
                self._abort(in_flight, refit_index=refit_index, reason=traceback.format_exc())
                raise RefitError(f"refit {refit_index} failed on the trainer: {error}") from error
            if in_flight is not None:
                self._await_ack(in_flight, refit_index=refit_index, telemetry=telemetry)
            first_send = first_send if first_send is not None else time.perf_counter()
            self._send(Message(kind="buffer", fields={
                "refit_index": refit_index, "buffer_index": buffer.index,
                "used_bytes": buffer.used_bytes, "checksum": checksum,
                "names": list(plan.buffer_names(buffer.index)),
            }), what=f"buffer {buffer.index}/{plan.num_buffers} of refit {refit_index}")
            in_flight = buffer.index
        self._await_ack(in_flight, refit_index=refit_index, telemetry=telemetry)
        telemetry.transfer_s = time.perf_counter() - first_send
        telemetry.export_s = reader.export_s
        if digests is not None:
            telemetry.verify_s = digests.seconds
        extra = reader.extra()
        if extra is not None:
            reason = (f"the weight source yielded more than the plan's {plan.num_tensors} "
                      f"tensors (next: {extra!r}); rebuild the plan when the model changes")
            self._abort(None, refit_index=refit_index, reason=reason)
            raise RefitError(f"refit {refit_index} failed on the trainer: {reason}")

    def _pack(self, buffer_index: int, reader: SourceReader, *, refit_index: int,
              digests: DigestRecorder | None, batched: bool,
              telemetry: RefitTelemetry) -> int | None:
        """Pull, pack, write the header and checksum; return once the bytes are in memory."""
        streams, slots, config = self._streams, self._slots, self._config
        started, exported = time.perf_counter(), reader.export_s
        verified = digests.seconds if digests is not None else 0.0
        streams.record(self._pack_events[0])
        slots.pack_from(buffer_index, reader, batched=batched, observe=digests)
        buffer = self.plan.buffers[buffer_index]
        header = BufferHeader(refit_index=refit_index, buffer_index=buffer_index,
                              status=BufferStatus.OK, used_bytes=buffer.used_bytes,
                              fingerprint_word=self.plan.fingerprint_words[0])
        header_view = slots.header_view(buffer_index)
        header_view.copy_(torch.tensor(header.to_words(), dtype=torch.int64))
        checksum = None
        if config.checksums:
            summed = time.perf_counter()
            buffer_checksum(slots.payload_words(buffer_index), out=header_view[5])
            checksum = int(header_view[5].item())
            telemetry.checksum_s += time.perf_counter() - summed
        streams.record(self._pack_events[1])
        # The engine reads the slot from another process: the bytes must be complete first.
        streams.host_wait(self._pack_events[1], timeout_s=config.timeout_s,
                          what=f"packing buffer {buffer_index}")
        if streams.is_cuda:
            telemetry.pack_s += streams.elapsed_s(*self._pack_events)
        else:
            digest_s = digests.seconds - verified if digests is not None else 0.0
            telemetry.pack_s += (time.perf_counter() - started - (reader.export_s - exported)
                                 - digest_s)
        return checksum

    def _await_ack(self, buffer_index: int, *, refit_index: int,
                   telemetry: RefitTelemetry) -> None:
        waited = time.perf_counter()
        names = self.plan.buffer_names(buffer_index)
        reply = self._receive(
            expect=("ack", "error"), timeout_s=self._config.timeout_s,
            what=f"the engine's ACK of buffer {buffer_index}/{self.plan.num_buffers} of refit "
                 f"{refit_index}")
        telemetry.wait_s += time.perf_counter() - waited
        if reply.kind == "error" or not reply.get("ok", bool):
            raise RefitError(
                f"the engine failed on buffer {buffer_index} of refit {refit_index} "
                f"(tensors {names[0]!r} .. {names[-1]!r}): {reply.fields.get('message')}")
        if reply.get("buffer_index", int) != buffer_index:
            raise RefitError(f"the engine acknowledged buffer {reply.fields['buffer_index']}, "
                             f"expected {buffer_index}")

    def _complete(self, *, refit_index: int, digests: DigestRecorder | None,
                  telemetry: RefitTelemetry) -> None:
        blobs = ()
        if digests is not None:
            started = time.perf_counter()
            blobs = (digests.table(self.plan.num_tensors).cpu().numpy().tobytes(),)
            telemetry.verify_s += time.perf_counter() - started
        reply = self._request(
            Message(kind="complete", fields={"refit_index": refit_index, "aborted": None},
                    blobs=blobs),
            expect=("summary", "error"), timeout_s=self._config.timeout_s,
            what=f"the engine's summary of refit {refit_index}")
        if reply.kind == "error" or not reply.get("ok", bool):
            raise RefitError(f"refit {refit_index} incomplete on the engine: "
                             f"{reply.fields.get('message')}")

    def _abort(self, in_flight: int | None, *, refit_index: int, reason: str) -> None:
        """Tell the engine the refit is off (best effort: the trainer raises regardless)."""
        try:
            if in_flight is not None:
                ack = self._receive(expect=("ack", "error"), timeout_s=self._config.timeout_s,
                                    what=f"the engine's ACK of buffer {in_flight}")
                if ack.kind == "error" or not ack.fields.get("ok"):
                    return  # the engine failed on its own and left the refit already
            self._request(
                Message(kind="complete", fields={"refit_index": refit_index, "aborted": reason}),
                expect=("summary", "error"), timeout_s=self._config.timeout_s,
                what=f"the engine's reply to aborting refit {refit_index}")
        except RefitError:
            pass

    # --- socket ----------------------------------------------------------------------------

    def _request(self, message: Message, *, expect, timeout_s: float, what: str) -> Message:
        self._send(message, what=message.kind)
        return self._receive(expect=expect, timeout_s=timeout_s, what=what)

    def _send(self, message: Message, *, what: str) -> None:
        timeout_s = self._config.start_timeout_s if message.kind == "hello" else \
            self._config.timeout_s
        if not self._socket.poll(int(timeout_s * 1000), zmq.POLLOUT):
            self._engine_ready = False
            raise RefitTimeout(f"timed out after {timeout_s:g} s waiting to send {what} to the "
                               f"engine at {self.address}: no engine process is connected")
        self._socket.send_multipart(encode(message), copy=False)

    def _receive(self, *, expect, timeout_s: float, what: str) -> Message:
        if not self._socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            self._engine_ready = False
            raise RefitTimeout(f"timed out after {timeout_s:g} s waiting for {what} at "
                               f"{self.address}; is the engine process alive?")
        try:
            reply = decode(self._socket.recv_multipart())
        except WireError as error:
            self._engine_ready = False
            raise RefitError(f"invalid reply while waiting for {what}: {error}") from None
        expected = expect if isinstance(expect, tuple) else (expect,)
        if reply.kind not in expected:
            if reply.kind == "error":
                raise RefitError(f"the engine replied with an error to {what}: "
                                 f"{reply.fields.get('message')}")
            raise RefitError(f"expected {' or '.join(expected)} for {what}, got {reply.kind}")
        return reply


@dataclass
class _RefitState:
    """What the engine tracks during one refit."""

    refit_index: int
    checksums: bool
    verify: bool
    loaded: bytearray
    next_buffer: int = 0
    failure: str | None = None
    telemetry: RefitTelemetry | None = None
    first_buffer_at: float | None = None


class IpcReceiver(RefitReceiver):
    """Engine end of the colocated transport: connects to the trainer's ``address``.

    ``plan=None`` adopts the trainer's plan from its hello; a given plan is checked against it.
    :meth:`receive` serves the trainer's messages until one refit completed.
    """

    transport_name = "ipc"

    def __init__(self, *, address: str, device: torch.device, config: RefitConfig,
                 plan: RefitPlan | None = None) -> None:
        self.address = address
        self._socket_path = path_of(address)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._streams = DeviceStreams(device)
        self._config = config
        self._own_plan = plan
        self._plan: RefitPlan | None = plan
        self._slots: BufferSlots | None = None
        self._context: zmq.Context | None = None
        self._socket: zmq.Socket | None = None
        self._memory = DeviceMemoryProbe(device, track_peak=config.track_peak_memory)
        self._staging = self._streams.staging(16, torch.int64)
        self._device_checksum = torch.zeros(1, dtype=torch.int64, device=device)

    @property
    def plan(self) -> RefitPlan | None:
        return self._plan

    def prepare(self) -> None:
        """Connect to the trainer's socket (the trainer need not be bound yet)."""
        if self._socket is not None:
            return
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.address)

    def receive(self, engine: WeightLoader) -> RefitTelemetry:
        """Serve one refit: hello (when sent), start, buffers, complete. Raises on failure."""
        assert self._socket is not None, "call prepare() before receive()"
        state: _RefitState | None = None
        start = None
        while True:
            timeout_s = self._config.start_timeout_s if state is None else self._config.timeout_s
            expecting = ("the trainer's start of a refit" if state is None else
                         f"the trainer's buffer {state.next_buffer} of refit {state.refit_index}")
            waited = time.perf_counter()
            message = self._next_message(timeout_s=timeout_s, what=expecting)
            if state is not None:
                state.telemetry.wait_s += time.perf_counter() - waited
            if message is None:
                continue
            if message.kind == "hello":
                reply = self._on_hello(message)
                self._reply(reply)
                if reply.kind == "error":
                    raise RefitError(f"cannot take the trainer's hello: {reply.fields['message']}")
            elif message.kind == "start":
                start = time.perf_counter()
                self._memory.start()
                state, reply = self._on_start(message)
                self._reply(reply)
                if reply.kind == "error" and not reply.fields.get("need_hello"):
                    raise RefitError(f"cannot start the trainer's refit: "
                                     f"{reply.fields['message']}")
            elif message.kind == "buffer" and state is not None:
                self._reply(self._on_buffer(message, state, engine))
                if state.failure is not None:
                    raise RefitError(f"refit {state.refit_index} failed on the engine: "
                                     f"{state.failure}")
            elif message.kind == "complete" and state is not None:
                reply = self._on_complete(message, state, engine)
                self._reply(reply)
                if reply.kind == "error" or not reply.fields.get("ok"):
                    raise RefitError(f"refit {state.refit_index} failed: "
                                     f"{reply.fields['message']}")
                telemetry = state.telemetry
                telemetry.total_s = time.perf_counter() - start
                if state.first_buffer_at is not None:
                    telemetry.transfer_s = time.perf_counter() - state.first_buffer_at
                telemetry.record_memory(self._memory.stop())
                return telemetry
            else:
                self._reply(_error(f"unexpected {message.kind} message "
                                   f"{'before a start' if state is None else 'during a refit'}"))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._context.term()
            self._socket = None
        if self._slots is not None:
            self._slots.close()
            self._slots = None

    # --- handlers --------------------------------------------------------------------------

    def _on_hello(self, message: Message) -> Message:
        try:
            plan = plan_from_json(message.get("plan", str))
            if self._own_plan is not None and self._own_plan != plan:
                return _error(_mismatch(self._own_plan, plan))
            key = message.get("device_key", str)
            if self._streams.is_cuda and key != gpu_uuid(self._streams.device):
                return _error(f"the trainer's buffers are on {key} but this engine is on "
                              f"{gpu_uuid(self._streams.device)}")
            slot_fields = message.get("slots", list)
            if len(slot_fields) != plan.num_slots_total:
                return _error(f"hello describes {len(slot_fields)} slots, plan needs "
                              f"{plan.num_slots_total}")
            slots = []
            for fields in slot_fields:
                first, count = fields.get("first_blob"), fields.get("num_blobs")
                if not isinstance(first, int) or not isinstance(count, int):
                    return _error("slot description lacks first_blob/num_blobs")
                slots.append(open_slot(fields, list(message.blobs[first:first + count]),
                                       device=self._streams.device,
                                       directory=self._socket_path.parent))
            if self._slots is not None:
                self._slots.close()
            self._slots = BufferSlots(plan=plan, slots=slots)
            self._plan = plan
        except (WireError, ValueError, RuntimeError, OSError) as error:
            self._slots = None
            return _error(f"cannot map the trainer's buffers: {error}")
        return Message(kind="ready", fields={"fingerprint": plan.fingerprint})

    def _on_start(self, message: Message) -> tuple[_RefitState | None, Message]:
        if self._slots is None:
            return None, Message(kind="error", fields={
                "message": "this engine has not mapped the trainer's buffers", "need_hello": True})
        try:
            fingerprint = message.get("fingerprint", str)
            refit_index = message.get("refit_index", int)
            checksums, verify = message.get("checksums", bool), message.get("verify", bool)
        except WireError as error:
            return None, _error(str(error))
        if fingerprint != self._plan.fingerprint:
            return None, _error(f"refit plan mismatch: the engine holds plan "
                                f"{self._plan.fingerprint[:16]}, the trainer sent "
                                f"{fingerprint[:16]}; build both from the same weight specs and "
                                "refit config")
        plan = self._plan
        telemetry = RefitTelemetry(
            role="receiver", transport=self.transport_name, refit_index=refit_index,
            device=str(self._streams.device), num_tensors=plan.num_tensors,
            num_buffers=plan.num_buffers, bytes=plan.total_bytes,
            buffer_bytes=0, checksums=checksums)
        state = _RefitState(refit_index=refit_index, checksums=checksums, verify=verify,
                            loaded=bytearray(plan.num_tensors), telemetry=telemetry)
        return state, Message(kind="started", fields={"refit_index": refit_index})

    def _on_buffer(self, message: Message, state: _RefitState, engine: WeightLoader) -> Message:
        plan = self._plan
        try:
            index = message.get("buffer_index", int)
            if message.get("refit_index", int) != state.refit_index:
                raise ValueError(f"buffer message of refit {message.fields['refit_index']} "
                                 f"during refit {state.refit_index}")
            if index != state.next_buffer:
                raise ValueError(f"buffer {index} arrived, expected {state.next_buffer}")
            if message.get("names", list) != list(plan.buffer_names(index)):
                raise ValueError(f"buffer {index} names differ from the plan's")
            if message.get("used_bytes", int) != plan.buffers[index].used_bytes:
                raise ValueError(f"buffer {index} used bytes differ from the plan's")
            checksum = message.fields.get("checksum")
            self._check_slot(index, state, sent_checksum=checksum)
            state.first_buffer_at = state.first_buffer_at or time.perf_counter()
            started = time.perf_counter()
            engine.load_weights(self._slots.named_views(index))
            # The trainer refills this slot as soon as it has the ACK: finish reading first.
            self._streams.synchronize(timeout_s=self._config.timeout_s,
                                      what=f"loading buffer {index}")
            state.telemetry.load_s += time.perf_counter() - started
        except Exception:
            state.failure = (f"buffer {message.fields.get('buffer_index')}: "
                             f"{traceback.format_exc()}")
            return Message(kind="ack", fields={"ok": False, "message": state.failure,
                                               "buffer_index": message.fields.get("buffer_index")})
        buffer = plan.buffers[index]
        for position in range(buffer.first_tensor, buffer.stop_tensor):
            state.loaded[position] = min(state.loaded[position] + 1, 255)
        state.next_buffer += 1
        return Message(kind="ack", fields={"ok": True, "buffer_index": index})

    def _check_slot(self, index: int, state: _RefitState, *, sent_checksum: object) -> None:
        """Check the in-buffer header (and checksum) against the message and the plan."""
        slots = self._slots
        self._staging[:8].copy_(slots.header_view(index))
        header = BufferHeader.from_words(self._staging[:8].tolist())
        header.check_expected(plan=self._plan, refit_index=state.refit_index, buffer_index=index)
        if state.checksums:
            buffer_checksum(slots.payload_words(index), out=self._device_checksum[0])
            received = int(self._device_checksum.item())
            if sent_checksum != received:
                raise ValueError(f"checksum mismatch in buffer {index}: sent {sent_checksum}, "
                                 f"received {received}")

    def _on_complete(self, message: Message, state: _RefitState,
                     engine: WeightLoader) -> Message:
        aborted = message.fields.get("aborted")
        if aborted is not None:
            return _error(f"the trainer aborted refit {state.refit_index}: {aborted}")
        plan = self._plan
        missing = [plan.names[i] for i, n in enumerate(state.loaded) if n == 0]
        repeated = [plan.names[i] for i, n in enumerate(state.loaded) if n > 1]
        problems = []
        if missing:
            problems.append(f"{len(missing)} planned tensors never loaded: {_some(missing)}")
        if repeated:
            problems.append(f"{len(repeated)} tensors loaded more than once: {_some(repeated)}")
        if state.verify and not problems:
            problems.extend(self._verify(message, state, engine))
        if problems:
            return Message(kind="summary", fields={"ok": False, "message": "; ".join(problems)})
        return Message(kind="summary", fields={
            "ok": True, "num_tensors": plan.num_tensors, "bytes": plan.total_bytes,
            "verified": state.verify, "message": None})

    def _verify(self, message: Message, state: _RefitState, engine: WeightLoader) -> list[str]:
        started = time.perf_counter()
        plan = self._plan
        if len(message.blobs) != 1 or len(message.blobs[0]) != plan.num_tensors * 3 * 8:
            return ["verification requested but the digest table is missing or malformed"]
        expected = torch.frombuffer(bytearray(message.blobs[0]), dtype=torch.int64).view(-1, 3)
        failure = verify_engine_weights(engine, plan.names,
                                        expected.to(self._streams.device))
        state.telemetry.verify_s = time.perf_counter() - started
        state.telemetry.verified = failure is None
        return [failure] if failure is not None else []

    # --- socket ----------------------------------------------------------------------------

    def _next_message(self, *, timeout_s: float, what: str) -> Message | None:
        if not self._socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise RefitTimeout(f"timed out after {timeout_s:g} s waiting for {what} at "
                               f"{self.address}; is the trainer alive?")
        frames = self._socket.recv_multipart()
        try:
            return decode(frames)
        except WireError as error:
            self._reply(_error(f"malformed message: {error}"))
            return None

    def _reply(self, message: Message) -> None:
        if not self._socket.poll(int(self._config.timeout_s * 1000), zmq.POLLOUT):
            raise RefitTimeout(f"timed out after {self._config.timeout_s:g} s sending a "
                               f"{message.kind} reply to the trainer at {self.address}")
        self._socket.send_multipart(encode(message), copy=False)


def _error(text: str) -> Message:
    return Message(kind="error", fields={"message": text})


def _mismatch(own: RefitPlan, sent: RefitPlan) -> str:
    return (f"refit plan mismatch: the engine holds plan {own.fingerprint[:16]} "
            f"({own.num_tensors} tensors), the trainer sent {sent.fingerprint[:16]} "
            f"({sent.num_tensors} tensors); build both from the same weight specs and refit config")


def _some(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_NAMES_SHOWN])
    return shown + (f" and {len(names) - _MAX_NAMES_SHOWN} more"
                    if len(names) > _MAX_NAMES_SHOWN else "")

