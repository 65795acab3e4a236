"""Stop signals: an interrupt is no failure, a failure's stop names the dead peer, every process
ends in bounded time, and none outlives its launcher."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mcore_refit.control import ControlError, PeerDied, raise_dead_peer_first
from mcore_refit.interrupts import StopSignals
from mcore_refit.processes import (
    Interrupted,
    PeerWatch,
    ProcessIdentity,
    Terminated,
    pid_running,
)
from tests.unit.test_processes import dead_watch

REPO_ROOT = Path(__file__).resolve().parents[2]


def alive_watch() -> PeerWatch:
    return PeerWatch(peers=((0, "trainer rank 0", ProcessIdentity.of()),), interval_s=0.5)


def test_a_stop_after_a_peer_died_raises_terminated_naming_it_once():
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(Terminated, match=r"^this rank was stopped by SIGTERM after trainer rank "
                                         r"1 \(pid \d+ on \S+\) died \(the launcher stops every "
                                         r"rank once one has failed\)$") as raised:
        with StopSignals(announce=False) as stops:
            stops.watch(dead_watch())
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            finally:
                os.kill(os.getpid(), signal.SIGINT)  # while unwinding: ignored
                time.sleep(0.1)
    assert not isinstance(raised.value, Interrupted)
    assert stops.stop.signum == signal.SIGTERM and not stops.stop.interrupts
    assert {signum: signal.getsignal(signum) for signum in previous} == previous
    time.sleep(StopSignals(announce=False).grace_s + 0.5)  # no forced exit once the block ended


def test_a_stop_while_a_rank_unwinds_from_its_own_failure_leaves_that_failure_and_its_clean_up():
    cleaned = []
    with pytest.raises(RuntimeError, match="^the rank's own failure$"):
        with StopSignals(announce=False) as stops:
            stops.watch(dead_watch())
            try:
                raise RuntimeError("the rank's own failure")
            except RuntimeError:
                with stops.unwinding():
                    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, after another rank
                    time.sleep(0.5)
                    cleaned.append("engine closed")
                raise
    assert cleaned == ["engine closed"]
    assert stops.stop.signum == signal.SIGTERM and not stops.stop.interrupts
    time.sleep(StopSignals(announce=False).grace_s + 0.5)  # no forced exit once the block ended


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_with_every_peer_alive_is_an_interrupt_said_in_one_line(signum, capsys):
    with pytest.raises(Interrupted) as raised:
        with StopSignals(announce=True) as stops:
            stops.watch(alive_watch())
            os.kill(os.getpid(), signum)
            time.sleep(5)
    name = signal.Signals(signum).name
    assert str(raised.value) == f"the run was stopped by {name}"
    assert raised.value.exit_code == 128 + signum
    assert capsys.readouterr().err == f"Interrupted: the run was stopped by {name}\n"


def test_a_sigterm_during_the_start_up_may_follow_another_ranks_failure(capsys):
    with pytest.raises(Interrupted) as raised:
        with StopSignals(announce=True):  # no peers known yet
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert str(raised.value) == (
        "the run was stopped by SIGTERM during its start-up (the user's, or the launcher's "
        "after another rank failed: that rank prints its error)")
    assert capsys.readouterr().err == f"Interrupted: {raised.value}\n"


def test_an_interrupt_blames_no_peer_and_is_reported_over_what_followed_it():
    watch = dead_watch()  # a peer that exited because of the same interrupt
    interrupted = Interrupted("the run was stopped by SIGINT", signum=signal.SIGINT)
    raise_dead_peer_first(watch, interrupted)  # returns: the caller re-raises it
    for later in (ControlError("the outcome failed: Connection closed by peer"),
                  PeerDied("trainer rank 1 (pid 7 on host) died while rank 0 waited for x")):
        try:
            try:
                raise interrupted
            finally:
                raise later  # noqa: B012
        except BaseException as error:
            with pytest.raises(Interrupted) as raised:
                raise_dead_peer_first(watch, error)
            assert raised.value is interrupted


def run_rank(code: str, tmp_path: Path, *,
             launcher: bool = False) -> tuple[subprocess.Popen, int, Path]:
    """Start ``code`` as a rank (under a launcher process of its own, with ``launcher``) with
    its stderr in a file; returns once it printed "ready <pid>": the process started, the
    rank's pid and its stderr file."""
    rank = tmp_path / "rank.py"
    rank.write_text(textwrap.dedent(code))
    stderr = tmp_path / "stderr"
    command = [sys.executable, str(rank)]
    if launcher:
        command = [sys.executable, "-c", "import subprocess, sys; "
                   f"subprocess.run({command!r}, stderr=open({str(stderr)!r}, 'w'))"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                               stderr=None if launcher else stderr.open("w"),
                               env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    ready, pid = process.stdout.readline().split()
    assert ready == "ready"
    return process, int(pid), stderr


def gone_within(pid: int, seconds: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if not pid_running(pid):
            return time.monotonic() - started
        time.sleep(0.02)
    return None


RANK = """
    import os, signal, sys, time
    from mcore_refit.interrupts import StopSignals
    from mcore_refit.processes import exit_after

    def main():
        with StopSignals(announce=True, grace_s=0.5):
            # The main thread stuck where no Python handler can run (signals go to other
            # threads while it blocks them): only the forced exit ends it.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            print("ready", os.getpid(), flush=True)
            time.sleep(60)
        return 0

    exit_after(main)
"""


def test_a_rank_stuck_in_a_call_exits_within_the_grace(tmp_path):
    process, _, stderr = run_rank(RANK, tmp_path)
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=10) == 128 + signal.SIGINT
    assert time.monotonic() - started < 2.5
    assert stderr.read_text() == "Interrupted: the run was stopped by SIGINT\n"


def test_a_rank_stops_when_its_launcher_dies(tmp_path):
    launcher, rank, stderr = run_rank(RANK, tmp_path, launcher=True)
    launcher.kill()  # kill -9: it signals nothing
    launcher.wait()
    seconds = gone_within(rank, 10.0)
    assert seconds is not None and seconds < 2.0, seconds
    assert stderr.read_text() == (f"Interrupted: the run was stopped: its launcher (pid "
                                  f"{launcher.pid} on {socket.gethostname()}) died\n")


FAILING_RANK = """
    import os, signal
    from mcore_refit.processes import exit_after

    class PeerGone(RuntimeError):
        def __str__(self):
            # The launcher's SIGTERM lands while the failure is being reported.
            os.kill(os.getpid(), signal.SIGTERM)
            return "trainer rank 1 (pid 4242) died"

    def main():
        print("ready", os.getpid(), flush=True)
        raise PeerGone()

    exit_after(main)
"""


def test_a_failed_rank_reports_its_failure_even_if_stopped_while_reporting(tmp_path):
    process, _, stderr = run_rank(FAILING_RANK, tmp_path)
    assert process.wait(timeout=30) == 1
    assert stderr.read_text().splitlines()[-1] == "PeerGone: trainer rank 1 (pid 4242) died"


FINISHED_RANK = """
    import sys
    from mcore_refit.processes import exit_after

    class Weights:  # stands for a model whose memory an engine read in place (CUDA IPC)
        def __del__(self):
            print("freed while finalizing" if sys.is_finalizing() else "freed before exit",
                  flush=True)

    def main():
        weights = Weights()
        weights.optimizer = {"params": weights}  # a model and its optimizer: a cycle
        return 0

    exit_after(main)
"""


def test_a_finished_rank_frees_what_its_run_left_in_cycles_before_it_exits(tmp_path):
    """At exit torch reports CUDA memory this process shared that is still alive (an engine
    read the weights in place); what the run left in reference cycles is freed before the
    interpreter's teardown, so that memory is returned first."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(FINISHED_RANK))
    result = subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert (result.returncode, result.stdout) == (0, "freed before exit\n"), result.stderr


TRAINER = """
    import os, sys, time
    from mcore_refit.inference.process import EngineProcess
    from tests.unit.test_generation import EchoServer, _EchoSpec

    if __name__ == "__main__":
        engine = EngineProcess(_EchoSpec(name="echo"), timeout_s=60.0, server=EchoServer)
        print("ready", engine.pid, flush=True)
        for line in sys.stdin:  # one echo per line, as long as the test asks
            print(engine.call("echo", line=line.strip())["kwargs"]["line"], flush=True)
"""


@pytest.mark.slow  # a trainer interpreter that starts an engine process (torch in both)
def test_an_engine_leaves_stop_signals_to_its_trainer_and_dies_with_it(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(TRAINER))
    trainer = subprocess.Popen([sys.executable, str(script)], cwd=REPO_ROOT, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        ready, engine = trainer.stdout.readline().split()
        engine = int(engine)
        # The launcher signals the rank's whole process group, the engine included.
        os.kill(engine, signal.SIGINT)
        os.kill(engine, signal.SIGTERM)
        trainer.stdin.write("still serving\n")
        trainer.stdin.flush()
        assert trainer.stdout.readline() == "still serving\n"
        trainer.kill()  # no clean-up runs in the trainer
        seconds = gone_within(engine, 10.0)
        assert seconds is not None and seconds < 1.0, seconds
    finally:
        trainer.kill()
        trainer.wait()
