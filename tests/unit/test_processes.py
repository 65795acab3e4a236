"""Which error a failing rank reports first (stop signals: test_interrupts.py)."""

import subprocess
import sys

import pytest

from mcore_refit.control import (
    ControlError,
    ControlTimeout,
    Outcome,
    PeerDied,
    RankFailure,
    raise_dead_peer_first,
)
from mcore_refit.processes import (
    PeerWatch,
    ProcessIdentity,
    Terminated,
    root_failure,
)


def dead_watch() -> PeerWatch:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = ProcessIdentity.of(child.pid)
    child.wait()
    return PeerWatch(peers=((0, "trainer rank 0", ProcessIdentity.of()),
                            (1, "trainer rank 1", identity)), interval_s=0.5)


def test_a_broken_wait_or_a_stop_blames_the_dead_peer_first():
    watch = dead_watch()
    assert watch.first_dead() is not None
    for error in (ControlError("the outcome failed: Connection closed by peer"),
                  ControlTimeout("timed out after 5 s"), Terminated("stopped"),
                  RuntimeError("[gloo/transport/tcp/pair.cc:547] Connection closed by peer "
                               "[127.0.0.1]:58031")):
        with pytest.raises(PeerDied, match=rf"^trainer rank 1 \(pid \d+ on \S+\) died; then "
                                           rf"this rank raised {type(error).__name__}: "):
            raise_dead_peer_first(watch, error)


def test_an_error_that_names_its_cause_is_kept():
    watch = dead_watch()
    failure = RankFailure("refit", [(1, Outcome(ok=False, error="EngineError: died",
                                                 error_type="EngineError"))],
                          who="trainer rank")
    raise_dead_peer_first(watch, failure)  # returns: the caller re-raises it
    raise_dead_peer_first(watch, ValueError("bad input"))
    alive = PeerWatch(peers=((0, "trainer rank 0", ProcessIdentity.of()),), interval_s=0.5)
    raise_dead_peer_first(alive, ControlTimeout("timed out"))
    assert watch.among([0]).first_dead() is None  # rank 1 is no member of that group
    # The launcher's stop, landing while the rank unwound from a shared failure: that failure.
    try:
        try:
            raise failure
        finally:
            raise Terminated("stopped")  # noqa: B012
    except Terminated as stopped:
        assert root_failure(stopped) is failure
        with pytest.raises(RankFailure) as raised:
            raise_dead_peer_first(watch, stopped)
        assert raised.value is failure
    assert root_failure(failure) is failure


def test_a_clean_up_error_after_a_named_failure_reports_that_failure():
    watch = dead_watch()
    first = PeerDied("trainer rank 1 (pid 7 on host) died while rank 0 waited for refit 1")
    try:
        try:
            raise first
        finally:
            raise PeerDied("inference rank 0 (pid 8 on host) died while rank 0 waited for "  # noqa: B012
                           "the stop command")
    except PeerDied as later:
        with pytest.raises(PeerDied) as raised:
            raise_dead_peer_first(watch, later)
        assert raised.value is first


def test_timeouts_are_recognised_by_type_not_by_name():
    """An expired wait is ``waited`` in the shared outcome (other ranks' failures come first);
    a type that merely has "Timeout" in its name is not one."""
    from mcore_refit.refit import RefitTimeout

    class TimeoutBudgetExceeded(RuntimeError):
        pass

    for error in (ControlTimeout("timed out after 5 s waiting for x"),
                  RefitTimeout("timed out after 5 s waiting for buffer 3"),
                  TimeoutError("vLLM's loader had not finished"),
                  subprocess.TimeoutExpired(["reward.sh"], 5)):
        assert Outcome.failed(error).waited, type(error).__name__
    assert not Outcome.failed(TimeoutBudgetExceeded("a real failure")).waited
    assert not Outcome.failed(ValueError("bad")).waited
