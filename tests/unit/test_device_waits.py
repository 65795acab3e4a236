"""DeviceStreams.host_wait: bounded waits for device events that hold neither a core nor the GIL.

The events here are stand-ins with CUDA events' ``query``/``synchronize`` (CPU has none), so
these tests cover the waiting, not CUDA; tests/gpu runs the same waits on real events.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mcore_refit.refit import DeviceStreams, RefitError, RefitTimeout


class FakeEvent:
    """Completes when ``complete()`` is called; ``synchronize`` blocks until then (without the
    GIL, as a lock wait), or raises ``failure`` if one is given."""

    def __init__(self, failure: BaseException | None = None) -> None:
        self._done = threading.Event()
        self._failure = failure

    def complete(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self._failure is not None:
            raise self._failure


class Peers:
    """A PeerWatch stand-in that reports a death after ``dead_after_s``."""

    interval_s = 0.02

    def __init__(self, dead_after_s: float) -> None:
        self._dead_at = time.monotonic() + dead_after_s

    def first_dead(self) -> str | None:
        return "inference rank 2 (pid 4242) exited with -9" if time.monotonic() > self._dead_at \
            else None


def complete_after(event: FakeEvent, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, event.complete)
    timer.start()
    return timer


def test_a_host_wait_returns_once_its_event_completed():
    streams = DeviceStreams(torch.device("cpu"))
    event = FakeEvent()
    complete_after(event, 0.05)
    start = time.monotonic()
    streams.host_wait(event, timeout_s=5, what="buffer 3")
    assert event.query()
    assert time.monotonic() - start < 2


def test_a_host_wait_lets_another_thread_run_python_while_it_waits():
    """The wait holds no GIL: a thread counting in Python meanwhile counts about as far as while
    this thread merely sleeps (a wait that spins holding the GIL lets it count about half as
    far on 2 cores; medians of three rounds each, taken in turn)."""

    def count_for(seconds: float, wait) -> int:
        stop = threading.Event()
        counted = [0]

        def count() -> None:
            while not stop.is_set():
                counted[0] += 1

        counter = threading.Thread(target=count)
        counter.start()
        wait(seconds)
        stop.set()
        counter.join()
        return counted[0]

    streams = DeviceStreams(torch.device("cpu"))

    def host_wait(seconds: float) -> None:
        event = FakeEvent()
        complete_after(event, seconds)
        streams.host_wait(event, timeout_s=5, what="buffer 0")

    beside_sleep, beside_wait = [], []
    for _ in range(3):
        beside_sleep.append(count_for(0.2, time.sleep))
        beside_wait.append(count_for(0.2, host_wait))
    assert sorted(beside_wait)[1] > 0.7 * sorted(beside_sleep)[1]


def test_a_host_wait_past_its_timeout_names_what_it_waited_for_and_the_next_wait_works():
    streams = DeviceStreams(torch.device("cpu"))
    never = FakeEvent()
    with pytest.raises(RefitTimeout) as raised:
        streams.host_wait(never, timeout_s=0.1, what="the release of slot 1")
    assert str(raised.value) == "timed out after 0.1 s waiting for the release of slot 1"
    # The thread blocked on the first event is abandoned; this wait gets a new one.
    event = FakeEvent()
    complete_after(event, 0.02)
    streams.host_wait(event, timeout_s=5, what="buffer 4")
    never.complete()


def test_a_host_wait_ends_naming_a_dead_peer_before_its_timeout():
    streams = DeviceStreams(torch.device("cpu"), peers=Peers(dead_after_s=0.05))
    never = FakeEvent()
    start = time.monotonic()
    with pytest.raises(RefitError) as raised:
        streams.host_wait(never, timeout_s=30, what="buffer 7")
    assert type(raised.value) is RefitError
    assert str(raised.value) == ("inference rank 2 (pid 4242) exited with -9 while this rank "
                                 "waited for buffer 7")
    assert time.monotonic() - start < 5
    never.complete()


def test_a_device_failure_during_a_host_wait_is_raised_in_the_waiting_thread():
    streams = DeviceStreams(torch.device("cpu"))
    failing = FakeEvent(failure=RuntimeError("CUDA error: an illegal memory access"))
    complete_after(failing, 0.02)
    with pytest.raises(RefitError) as raised:
        streams.host_wait(failing, timeout_s=5, what="buffer 2")
    assert str(raised.value) == "the device failed while this rank waited for buffer 2"
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_waits_from_two_threads_do_not_queue_behind_each_other():
    """Each waiting thread has its own waiter: an event that completes early is not held up
    behind another thread's event that completes late."""
    streams = DeviceStreams(torch.device("cpu"))
    late = FakeEvent()
    waiting_late = threading.Thread(
        target=streams.host_wait, args=(late,), kwargs={"timeout_s": 5, "what": "late"})
    waiting_late.start()
    time.sleep(0.02)
    early = FakeEvent()
    complete_after(early, 0.02)
    start = time.monotonic()
    streams.host_wait(early, timeout_s=5, what="early")
    assert time.monotonic() - start < 1
    assert not late.query()
    late.complete()
    waiting_late.join(timeout=5)


def test_a_waiter_thread_ends_after_the_thread_it_served(monkeypatch):
    """A thread that waited once and ended leaves no thread behind (the waiter checks its owner
    whenever it has been idle for _IDLE_CHECK_S)."""
    from mcore_refit.refit import streams as streams_module

    monkeypatch.setattr(streams_module, "_IDLE_CHECK_S", 0.02)

    def wait_once() -> None:
        event = FakeEvent()
        complete_after(event, 0.01)
        DeviceStreams(torch.device("cpu")).host_wait(event, timeout_s=5, what="buffer 1")

    def waiters() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate()
                if thread.name == "mcore-refit-event-waiter" and thread.is_alive()]

    before = set(waiters())
    served = threading.Thread(target=wait_once)
    served.start()
    served.join()
    deadline = time.monotonic() + 5
    while set(waiters()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(waiters()) - before
