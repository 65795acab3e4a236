"""Colocated transport, engine end: serves the trainer's messages (see :mod:`.sender`, and
:mod:`.shared_weights` for a trainer that shares its own tensors instead of slots).

The engine process connects a ZMQ REP socket to the trainer's address, maps the trainer's slots
once (at the trainer's hello), and per refit: checks the start against its plan, loads every
buffer from the mapped slot after checking its in-slot header (and checksum), synchronises before
each ACK (the trainer refills the slot once it has the ACK), and at the end checks that every
planned tensor was loaded exactly once (and, when verifying, equals the trainer's digests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import zmq

from mcore_refit.refit.buffers import BufferSlots, check_buffer
from mcore_refit.refit.checksum import DIGEST_WORDS, buffer_checksum, verify_engine_weights
from mcore_refit.refit.config import TransportOptions
from mcore_refit.refit.engines import WeightLoader, load_into
from mcore_refit.refit.errors import RefitError, RefitTimeout, failed
from mcore_refit.refit.plan import RefitPlan, plan_from_json
from mcore_refit.refit.streams import DeviceMemoryProbe, DeviceStreams
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transports.base import RefitReceiver
from mcore_refit.refit.transports.colocated.shared_weights import shared_views
from mcore_refit.refit.transports.ipc_files import gpu_uuid, open_slot, path_of
from mcore_refit.refit.transports.wire import (
    Ack,
    BufferReady,
    Complete,
    Error,
    Hello,
    Message,
    Ready,
    ShareWeights,
    Start,
    Started,
    Summary,
    WeightsReady,
    WireError,
    decode,
    encode,
)

_MAX_NAMES_SHOWN = 10


@dataclass
class _RefitState:
    """What the engine tracks during one refit."""

    refit_index: int
    checksums: bool
    verify: bool
    loaded: bytearray
    telemetry: RefitTelemetry
    next_buffer: int = 0
    failure: RefitError | None = None
    first_buffer_at: float | None = None


class ColocatedReceiver(RefitReceiver):
    """Engine end of the colocated transport: connects to the trainer's ``address``.

    ``plan=None`` adopts the trainer's plan from its hello; a given plan is checked against it.
    :meth:`receive` serves the trainer's messages until one refit completed.
    """

    transport_name = "colocated"

    def __init__(self, *, address: str, device: torch.device, options: TransportOptions,
                 plan: RefitPlan | None = None) -> None:
        self.address = address
        self._socket_path = path_of(address)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._streams = DeviceStreams(device)
        self._options = options
        self._own_plan = plan
        self._plan: RefitPlan | None = plan
        self._slots: BufferSlots | None = None
        # The trainer shares its tensors instead of slots: True after such a hello; then the
        # mapped tensors (in plan order) and the trainer's key for them, once shared.
        self._shares_weights = False
        self._shared: list[tuple] | None = None
        self._shared_key: str | None = None
        self._context: zmq.Context | None = None
        self._socket: zmq.Socket | None = None
        self._memory = DeviceMemoryProbe(device, track_peak=options.track_peak_memory)
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
        options = self._options
        state: _RefitState | None = None
        start = None
        while True:
            timeout_s = options.start_timeout_s if state is None else options.timeout_s
            expecting = ("the trainer's start of a refit" if state is None else
                         f"the trainer's buffer {state.next_buffer} of refit {state.refit_index}")
            waited = time.perf_counter()
            message = self._next_message(timeout_s=timeout_s, what=expecting)
            if state is not None:
                state.telemetry.wait_s += time.perf_counter() - waited
            if message is None:
                continue
            if isinstance(message, Hello):
                reply = self._on_hello(message)
                self._reply(reply)
                if isinstance(reply, Error):
                    raise RefitError(f"cannot take the trainer's hello: {reply.message}")
            elif isinstance(message, Start):
                start = time.perf_counter()
                self._memory.start()
                state, reply = self._on_start(message)
                self._reply(reply)
                if isinstance(reply, Error) and not reply.need_hello:
                    raise RefitError(f"cannot start the trainer's refit: {reply.message}")
            elif isinstance(message, ShareWeights):
                reply = self._on_share(message)
                self._reply(reply)
                if isinstance(reply, Error):
                    raise RefitError(f"cannot map the trainer's weights: {reply.message}")
            elif isinstance(message, WeightsReady) and state is not None:
                self._reply(self._on_weights_ready(message, state, engine))
                if state.failure is not None:
                    raise RefitError(f"refit {state.refit_index} failed on the engine: "
                                     f"{state.failure}") from state.failure
            elif isinstance(message, BufferReady) and state is not None:
                self._reply(self._on_buffer(message, state, engine))
                if state.failure is not None:
                    raise RefitError(f"refit {state.refit_index} failed on the engine: "
                                     f"{state.failure}") from state.failure
            elif isinstance(message, Complete) and state is not None:
                reply = self._on_complete(message, state, engine)
                self._reply(reply)
                if isinstance(reply, Error) or not reply.ok:
                    raise RefitError(f"refit {state.refit_index} failed: {reply.message}")
                telemetry = state.telemetry
                telemetry.total_s = time.perf_counter() - start
                if state.first_buffer_at is not None:
                    telemetry.transfer_s = time.perf_counter() - state.first_buffer_at
                telemetry.record_memory(self._memory.stop())
                return telemetry
            else:
                when = "before a start" if state is None else "during a refit"
                self._reply(Error(message=f"unexpected {message.KIND} message {when}"))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._context.term()
            self._socket = None
        self._release()

    # --- handlers -------------------------------------------------------------------------

    def _on_hello(self, message: Hello) -> Message:
        try:
            plan = plan_from_json(message.plan)
            if self._own_plan is not None and self._own_plan != plan:
                return Error(message=_mismatch(self._own_plan, plan))
            if self._streams.is_cuda and message.device_key != gpu_uuid(self._streams.device):
                return Error(message=f"the trainer's buffers are on {message.device_key} but "
                                     f"this engine is on {gpu_uuid(self._streams.device)}")
            expected = 0 if message.shares_weights else plan.num_held_slots
            if len(message.slots) != expected:
                return Error(message=f"hello describes {len(message.slots)} slots, plan needs "
                                     f"{expected}")
            slots = [open_slot(handle, message.blobs, device=self._streams.device,
                               directory=self._socket_path.parent) for handle in message.slots]
            self._release()
            if not message.shares_weights:
                self._slots = BufferSlots(plan=plan, slots=slots, all_buffers=True)
            self._shares_weights = message.shares_weights
            self._plan = plan
        except (WireError, ValueError, RuntimeError, OSError) as error:
            self._release()
            return Error(message=f"cannot map the trainer's buffers: {error}")
        return Ready(fingerprint=plan.fingerprint)

    def _on_share(self, message: ShareWeights) -> Message:
        """Map the trainer's storages and a view of every planned tensor in them."""
        if not self._shares_weights:
            return Error(message="the trainer shares weights without a hello saying so",
                         need_hello=True)
        plan = self._plan
        self._shared, self._shared_key = None, None
        try:
            if len(message.tensors) != plan.num_tensors:
                raise ValueError(f"{len(message.tensors)} shared tensors, the plan has "
                                 f"{plan.num_tensors}")
            storages = [open_slot(handle, message.blobs, device=self._streams.device,
                                  directory=self._socket_path.parent).untyped_storage()
                        for handle in message.storages]
            shared = []
            for planned, where in zip(plan.tensors, message.tensors, strict=True):
                shared += shared_views(storages, where, planned.spec, self._streams.device)
        except (WireError, ValueError, RuntimeError, OSError) as error:
            return Error(message=f"cannot map the trainer's weights: {error}")
        self._shared, self._shared_key = shared, message.key
        return Ready(fingerprint=plan.fingerprint)

    def _on_weights_ready(self, message: WeightsReady, state: _RefitState,
                          engine: WeightLoader) -> Message:
        """Load every planned tensor straight from the trainer's memory."""
        try:
            if message.refit_index != state.refit_index:
                raise ValueError(f"weights of refit {message.refit_index} during refit "
                                 f"{state.refit_index}")
            if self._shared is None:
                raise ValueError("the trainer announced weights it has not shared")
            state.first_buffer_at = time.perf_counter()
            load_into(engine, self._shared, in_place=True)
            # The trainer may change its weights once it has the reply: finish reading first.
            self._streams.synchronize(timeout_s=self._options.timeout_s,
                                      what=f"loading refit {state.refit_index}")
            state.telemetry.load_s += time.perf_counter() - state.first_buffer_at
        except Exception as error:
            state.failure = failed("loading the shared weights", error)
            return Ack(buffer_index=0, ok=False, message=str(state.failure))
        for position in range(len(state.loaded)):
            state.loaded[position] = min(state.loaded[position] + 1, 255)
        return Ack(buffer_index=0, ok=True)

    def _release(self) -> None:
        """Drop every mapping of the trainer's memory (slots or shared tensors)."""
        if self._slots is not None:
            self._slots.close()
        self._slots = None
        self._shared, self._shared_key = None, None

    def _on_start(self, message: Start) -> tuple[_RefitState | None, Message]:
        if self._slots is None and not self._shares_weights:
            return None, Error(message="this engine has not mapped the trainer's buffers",
                               need_hello=True)
        plan = self._plan
        if message.fingerprint != plan.fingerprint:
            return None, Error(message=f"refit plan mismatch: the engine holds plan "
                                       f"{plan.fingerprint[:16]}, the trainer sent "
                                       f"{message.fingerprint[:16]}; build both from the same "
                                       "weight specs and refit config")
        telemetry = RefitTelemetry.for_plan(
            plan, role="receiver", refit_index=message.refit_index, device=self._streams.device,
            transport="colocated_weights" if self._shares_weights else self.transport_name,
            held_bytes=self._slots.held_bytes if self._slots is not None else 0,
            checksums=message.checksums)
        state = _RefitState(refit_index=message.refit_index, checksums=message.checksums,
                            verify=message.verify, loaded=bytearray(plan.num_tensors),
                            telemetry=telemetry)
        return state, Started(refit_index=message.refit_index, shared_key=self._shared_key)

    def _on_buffer(self, message: BufferReady, state: _RefitState,
                   engine: WeightLoader) -> Message:
        plan, index = self._plan, message.buffer_index
        try:
            if message.refit_index != state.refit_index:
                raise ValueError(f"buffer message of refit {message.refit_index} during refit "
                                 f"{state.refit_index}")
            if index != state.next_buffer:
                raise ValueError(f"buffer {index} arrived, expected {state.next_buffer}")
            self._check_slot(index, state)
            state.first_buffer_at = state.first_buffer_at or time.perf_counter()
            started = time.perf_counter()
            load_into(engine, self._slots.entries(index), held=plan.slot_per_buffer)
            # The trainer refills this slot as soon as it has the ACK: finish reading first.
            self._streams.synchronize(timeout_s=self._options.timeout_s,
                                      what=f"loading buffer {index}")
            state.telemetry.load_s += time.perf_counter() - started
        except RefitError as error:  # the buffer's own check: it names the buffer
            state.failure = error
            return Ack(buffer_index=index, ok=False, message=str(state.failure))
        except Exception as error:
            state.failure = failed(f"buffer {index}", error)
            return Ack(buffer_index=index, ok=False, message=str(state.failure))
        buffer = plan.buffers[index]
        for position in range(buffer.first_tensor, buffer.stop_tensor):
            state.loaded[position] = min(state.loaded[position] + 1, 255)
        state.next_buffer += 1
        return Ack(buffer_index=index, ok=True)

    def _check_slot(self, index: int, state: _RefitState) -> None:
        """Check the in-slot header (and checksum) against the plan."""
        slots = self._slots
        checksum = None
        if state.checksums:
            buffer_checksum(slots.payload_words(index), out=self._device_checksum[0])
            checksum = int(self._device_checksum.item())
        check_buffer(slots.header_view(index).tolist(), plan=self._plan, buffer_index=index,
                     refit_index=state.refit_index, checksum=checksum)

    def _on_complete(self, message: Complete, state: _RefitState,
                     engine: WeightLoader) -> Message:
        if message.aborted is not None:
            return Error(message=f"the trainer aborted refit {state.refit_index}: "
                                 f"{message.aborted}")
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
            return Summary(ok=False, message="; ".join(problems))
        return Summary(ok=True, num_tensors=plan.num_tensors, payload_bytes=plan.payload_bytes,
                       verified=state.verify)

    def _verify(self, message: Complete, state: _RefitState,
                engine: WeightLoader) -> list[str]:
        started = time.perf_counter()
        plan = self._plan
        expected_bytes = plan.num_tensors * DIGEST_WORDS * 8
        if len(message.blobs) != 1 or len(message.blobs[0]) != expected_bytes:
            return ["verification requested but the digest table is missing or malformed"]
        expected = torch.frombuffer(bytearray(message.blobs[0]), dtype=torch.int64).view(
            -1, DIGEST_WORDS)
        failure = verify_engine_weights(engine, plan.specs(), expected.to(self._streams.device))
        state.telemetry.verify_s = time.perf_counter() - started
        state.telemetry.verified = failure is None
        return [failure] if failure is not None else []

    # --- socket ---------------------------------------------------------------------------

    def _next_message(self, *, timeout_s: float, what: str) -> Message | None:
        if not self._socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise RefitTimeout(f"timed out after {timeout_s:g} s waiting for {what} at "
                               f"{self.address}; is the trainer alive?")
        frames = self._socket.recv_multipart()
        try:
            return decode(frames)
        except WireError as error:
            self._reply(Error(message=f"malformed message: {error}"))
            return None

    def _reply(self, message: Message) -> None:
        if not self._socket.poll(int(self._options.timeout_s * 1000), zmq.POLLOUT):
            raise RefitTimeout(f"timed out after {self._options.timeout_s:g} s sending a "
                               f"{message.KIND} reply to the trainer at {self.address}")
        self._socket.send_multipart(encode(message), copy=False)


def _mismatch(own: RefitPlan, sent: RefitPlan) -> str:
    return (f"refit plan mismatch: the engine holds plan {own.fingerprint[:16]} "
            f"({own.num_tensors} tensors), the trainer sent {sent.fingerprint[:16]} "
            f"({sent.num_tensors} tensors); build both from the same weight specs and refit config")


def _some(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_NAMES_SHOWN])
    return shown + (f" and {len(names) - _MAX_NAMES_SHOWN} more"
                    if len(names) > _MAX_NAMES_SHOWN else "")
