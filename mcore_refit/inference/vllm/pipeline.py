"""vLLM's load of one buffer's tensors overlapped with the transport's receiving of the next.

A refit's engine side is, per buffer: wait for its bytes, copy its tensors out of the slot (into
the staging), hand them to vLLM's loader. vLLM's layerwise reload does its real work there — a
layer whose weights have all arrived is rebuilt, processed (on CPU: repacked for oneDNN) and
copied into the tensors the engine computes with — and done in the receiving loop, that work
holds the next buffer back: the refit costs the transport *plus* vLLM's load. :class:`LoadPipeline`
runs the loads on a thread of their own, one after another in arrival order, so the receiving
loop returns to the wire (and frees the slot) as soon as a buffer is staged; the refit then costs
about the larger of the two. vLLM's kernels release the GIL; its Python between them does not,
which bounds the overlap on a busy host.

On CUDA the loads run on a stream of the thread's own, so the receiving thread's copies and
waits never queue behind them. Events order the two: the loads' stream waits for the staging
copies, and :meth:`LoadPipeline.drain` makes the caller's stream wait for the loads' work in
turn, so whatever the caller does next (vLLM's finalisation, the next refit's staging copies
into the same memory) comes after it on the device too.

Loads that queued up while an earlier one ran are merged into one call: each call into vLLM's
loader has a fixed cost (the model's ``load_weights`` walks its parameters and loaders), so when
buffers arrive faster than vLLM loads them, the loads catch up in a few large calls instead of
one call per buffer.

vLLM's load is mostly Python, so the two threads share the GIL, and the loading thread holds it
most of the time. Each time the receiving thread returns from a wait it needs the GIL back
(several times per buffer), and the interpreter makes a thread that wants it wait its switch
interval (5 ms by default) before taking it from a busy one. While loads are queued or running,
the switch interval is therefore :data:`SWITCH_INTERVAL_S`; the process's own comes back when the
pipeline is drained. (Measured on 2x H200 together with receiver waits that give the GIL up:
docs/benchmarks.md, "The refit into vLLM".)
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

Weights = Sequence[tuple[str, torch.Tensor]]

# The interpreter's switch interval while loads run beside a refit's receive (see above).
SWITCH_INTERVAL_S = 5e-4


@dataclass
class _Entry:
    """One queued piece of work: tensors to load, or another step (``weights`` is ``None``)."""

    what: str  # names it in a failure
    staged: torch.cuda.Event | None  # the caller's device work before it was queued (CUDA)
    weights: list[tuple[str, torch.Tensor]] | None = None
    step: Callable[[], None] | None = None


class LoadPipeline:
    """Runs ``load(weights)`` for every :meth:`submit` (and any other step given to
    :meth:`run`) on one background thread, in order; loads queued back to back while the thread
    was busy go to ``load`` as one call.

    A step that raises stops the pipeline: later steps are skipped and the failure is raised,
    naming the tensors (or the step), by the next :meth:`submit` and by :meth:`drain`. ``device``:
    where the loads run (the thread takes it as its current CUDA device). The thread starts at
    the first :meth:`submit`; :meth:`close` stops it (a later submit starts another).
    """

    def __init__(self, load: Callable[[Weights], None], *, device: torch.device) -> None:
        device = torch.device(device)
        self._cuda = device.type == "cuda"
        if self._cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self._load = load
        self._executor: ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None  # the loads' stream (CUDA)
        self._queue: deque[_Entry] = deque()
        self._queue_lock = threading.Lock()
        self._pending: list[Future] = []
        self._failure: BaseException | None = None
        self._failed_on: str | None = None  # what the failed step was doing
        self._saved_switch_interval: float | None = None  # the process's, while loads run
        # Seconds spent in the steps (loads and others), and the calls into ``load``, since the
        # last reset_timing().
        self.load_s = 0.0
        self.load_cpu_s = 0.0
        self.load_calls = 0

    @property
    def busy(self) -> bool:
        """A submitted load has not returned yet."""
        return any(not future.done() for future in self._pending)

    def reset_timing(self) -> None:
        self.load_s = 0.0
        self.load_cpu_s = 0.0
        self.load_calls = 0

    def submit(self, weights: Weights) -> None:
        """Queue ``load(weights)`` after every earlier submission; raises the failure of an
        earlier load instead, if one failed. The caller's device work so far (the copies that
        filled ``weights``) is done before the load reads them."""
        self._queue_entry(weights=list(weights))

    def run(self, step: Callable[[], None], *, what: str) -> None:
        """Queue ``step()`` after every earlier submission, like a load (``what`` names it in a
        failure: "vLLM's loader failed <what>")."""
        self._queue_entry(step=step, what=what)

    def drain(self, *, timeout_s: float) -> None:
        """Wait until every submitted load returned (``timeout_s`` in all: a
        :class:`TimeoutError` naming it), then raise the first failure, if any. On CUDA the
        caller's current stream then waits for the loads' device work."""
        deadline = time.monotonic() + timeout_s
        pending, self._pending = self._pending, []
        for position, future in enumerate(pending):
            try:
                done = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                self._pending = pending[position:]
                with self._queue_lock:
                    queued = len(self._queue)
                raise TimeoutError(f"vLLM's loader had not finished the refit's last buffers "
                                   f"{timeout_s:.0f} s after they arrived ({queued} more "
                                   "queued behind the one running)") from None
            if done is not None:
                torch.cuda.current_stream(self._device).wait_event(done)
        self._restore_switch_interval()
        self._raise_failure()

    def close(self) -> None:
        """Stop the thread (queued loads are dropped, a running one finishes). Idempotent."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        with self._queue_lock:
            self._queue.clear()
        self._pending = []
        self._restore_switch_interval()

    # --- internals -------------------------------------------------------------------------

    def _init_thread(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self._device)
            # The loads get a stream of their own (the current stream is per thread). On the
            # device's default stream, which the receiving thread's copies and waits also use,
            # each buffer's hand-over would wait on the device for the loads queued before it.
            # Events order the two streams.
            self._stream = torch.cuda.Stream(self._device)
            torch.cuda.set_stream(self._stream)

    def _queue_entry(self, *, weights: list[tuple[str, torch.Tensor]] | None = None,
                     step: Callable[[], None] | None = None, what: str = "") -> None:
        self._raise_failure()
        staged = None
        if self._cuda:
            staged = torch.cuda.Event()
            staged.record(torch.cuda.current_stream(self._device))
        if self._saved_switch_interval is None:
            self._saved_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        with self._queue_lock:
            self._queue.append(_Entry(what=what, staged=staged, weights=weights, step=step))
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-load",
                                                initializer=self._init_thread)
        # One task per entry: a task takes the entry at the head of the queue (with the loads
        # queued right behind it), so a task may find its entry already taken by an earlier one.
        self._pending.append(self._executor.submit(self._run_next))

    def _take(self) -> _Entry | None:
        """The entry at the head of the queue, merged with the loads queued right behind it."""
        with self._queue_lock:
            if not self._queue:
                return None
            entry = self._queue.popleft()
            if entry.weights is None:
                return entry
            weights, staged = list(entry.weights), entry.staged
            while self._queue and self._queue[0].weights is not None:
                following = self._queue.popleft()
                weights += following.weights
                staged = following.staged
        first, last = (weights[0][0], weights[-1][0]) if weights else ("", "")
        return _Entry(what=f"on the tensors {first!r} .. {last!r}", staged=staged,
                      weights=weights)

    def _run_next(self) -> torch.cuda.Event | None:
        entry = self._take()
        if entry is None or self._failure is not None:
            return None
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            if entry.staged is not None:
                torch.cuda.current_stream(self._device).wait_event(entry.staged)
            with torch.no_grad():
                if entry.weights is None:
                    entry.step()
                else:
                    self.load_calls += 1
                    self._load(entry.weights)
            if not self._cuda:
                return None
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self._device))
            return done
        except BaseException as error:
            self._failure, self._failed_on = error, entry.what
            return None
        finally:
            self.load_s += time.perf_counter() - started
            self.load_cpu_s += time.thread_time() - cpu_started

    def _restore_switch_interval(self) -> None:
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None

    def _raise_failure(self) -> None:
        if self._failure is None:
            return
        error, what = self._failure, self._failed_on
        self._failure, self._failed_on = None, None
        raise RuntimeError(f"vLLM's loader failed {what} ({type(error).__name__}: {error})"
                           ) from error
