"""CUDA streams and events where the device is a GPU; host-ordered no-ops where it is the CPU.

Transports call these helpers instead of ``torch.cuda`` directly, so the same code runs with CPU
tensors (gloo, shared memory) without relying on any global patching of ``torch.cuda``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import torch

from mcore_refit.refit.errors import RefitError, RefitTimeout


class _Completion(threading.Event):
    """Set by the waiter thread when its event completed; ``error`` if synchronizing raised."""

    error: BaseException | None = None


# How often an idle waiter thread checks that the thread it serves is still alive.
_IDLE_CHECK_S = 5.0


class _EventWaiter:
    """A daemon thread that blocks in ``event.synchronize()`` (without the GIL) for each event
    handed to it, in order, and then sets that event's completion, so waits need no polling.
    One per thread that waits (events of different streams may complete out of order)."""

    def __init__(self) -> None:
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._owner = threading.current_thread()
        threading.Thread(target=self._run, name="mcore-refit-event-waiter", daemon=True).start()

    def submit(self, event) -> _Completion:
        done = _Completion()
        self._pending.put((event, done))
        return done

    def _run(self) -> None:
        while True:
            try:
                event, done = self._pending.get(timeout=_IDLE_CHECK_S)
            except queue.Empty:
                if not self._owner.is_alive():
                    return  # the thread it waited for has ended: nothing more can come
                continue
            try:
                event.synchronize()
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                done.error = error
            done.set()


# The calling thread's waiter; dropped when a wait times out (its thread may never come back).
_waiters = threading.local()


class DeviceStreams:
    """Stream/event helpers for one device."""

    def __init__(self, device: torch.device, *, peers=None) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        # A PeerWatch: host waits also end, naming it, when a peer process died (a device
        # collective with a dead peer never completes).
        self.peers = peers

    def new_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.Stream(device=self.device) if self.is_cuda else None

    def use(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        """Make ``stream`` current (a no-op on CPU)."""
        if stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(stream)

    def new_event(self, *, timing: bool = False) -> torch.cuda.Event | None:
        return torch.cuda.Event(enable_timing=timing) if self.is_cuda else None

    def record(self, event: torch.cuda.Event | None,
               stream: torch.cuda.Stream | None = None) -> None:
        """Record ``event`` on ``stream`` (the current stream when None)."""
        if event is not None:
            event.record(stream if stream is not None else torch.cuda.current_stream(self.device))

    def stream_wait(self, event: torch.cuda.Event | None,
                    stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait for ``event`` without blocking the host."""
        if event is not None:
            (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(
                event)

    def host_wait(self, event: torch.cuda.Event | None, *, timeout_s: float, what: str) -> None:
        """Block the host until ``event`` completed, or raise :class:`RefitTimeout` naming ``what``.

        ``event.synchronize()`` cannot time out, so it runs on a waiter thread (one per calling
        thread) while the caller sleeps on a lock with a deadline, waking every
        ``peers.interval_s`` to ask whether a peer died. Neither thread polls or holds the GIL
        while the device works, so another thread of the process (vLLM's loads beside a refit's
        receive) is not interrupted by the wait.
        """
        if event is None or event.query():
            return
        waiter = getattr(_waiters, "current", None)
        if waiter is None:
            waiter = _waiters.current = _EventWaiter()
        done = waiter.submit(event)
        deadline = time.monotonic() + timeout_s
        interval = self.peers.interval_s if self.peers is not None else timeout_s
        while not done.wait(min(interval, max(deadline - time.monotonic(), 0.0))):
            if time.monotonic() >= deadline:
                _waiters.current = None
                raise RefitTimeout(f"timed out after {timeout_s:g} s waiting for {what}")
            dead = self.peers.first_dead() if self.peers is not None else None
            if dead is not None:
                _waiters.current = None
                raise RefitError(f"{dead} while this rank waited for {what}")
        if done.error is not None:
            raise RefitError(f"the device failed while this rank waited for {what}") \
                from done.error

    def synchronize(self, *, timeout_s: float, what: str) -> None:
        """Wait for all work queued on this device's current stream (with a timeout)."""
        if self.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.host_wait(event, timeout_s=timeout_s, what=what)

    def elapsed_s(self, start: torch.cuda.Event | None, end: torch.cuda.Event | None) -> float:
        """Seconds between two completed timing events (0 on CPU)."""
        if start is None or end is None:
            return 0.0
        return start.elapsed_time(end) / 1e3

    def staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor for small device↔host copies: pinned on CUDA, so they can be async."""
        return torch.zeros(numel, dtype=dtype, pin_memory=self.is_cuda)


class DeviceMemoryProbe:
    """Device allocator counters around a refit: peak extra bytes, allocations, new segments."""

    def __init__(self, device: torch.device, *, track_peak: bool) -> None:
        self._device = torch.device(device)
        self._enabled = self._device.type == "cuda"
        self._track_peak = track_peak
        self._start: dict[str, int] = {}

    def start(self) -> None:
        if not self._enabled:
            return
        if self._track_peak:
            torch.cuda.reset_peak_memory_stats(self._device)
        self._start = self._counters()

    def stop(self) -> dict[str, int | None]:
        """``peak_transient_bytes``, ``new_allocations``, ``new_segments`` since :meth:`start`."""
        if not self._enabled:
            return {"peak_transient_bytes": None, "new_allocations": None, "new_segments": None}
        end = self._counters()
        return {
            "peak_transient_bytes": (end["peak"] - self._start["allocated"]
                                     if self._track_peak else None),
            "new_allocations": end["allocations"] - self._start["allocations"],
            "new_segments": end["segments"] - self._start["segments"],
        }

    def _counters(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats(self._device)
        return {
            "allocated": stats.get("allocated_bytes.all.current", 0),
            "peak": stats.get("allocated_bytes.all.peak", 0),
            "allocations": stats.get("allocation.all.allocated", 0),
            "segments": stats.get("segment.all.allocated", 0),
        }
