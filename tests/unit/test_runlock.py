"""One writer per run directory (issue 24, point 1): the lock of ``run.output_dir``."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from mcore_refit.config import ConfigError
from mcore_refit.grpo.runlock import LOCK_FILE, RunDirectoryInUse, RunLock

HOLD = """
import sys, time
from mcore_refit.grpo.runlock import RunLock
lock = RunLock(sys.argv[1], job="other-job")
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A process of another launch that holds ``tmp_path/run``'s lock until killed."""
    directory = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "held"
        yield directory, process
    finally:
        process.kill()
        process.wait()


def test_a_second_run_is_refused_naming_the_directory_and_the_holder(holder):
    directory, process = holder
    started = time.monotonic()
    with pytest.raises(RunDirectoryInUse) as refused:
        RunLock(directory, job="mine").acquire()
    assert time.monotonic() - started < 1.0
    message = str(refused.value)
    assert message.startswith(f"run.output_dir '{directory}' is in use by another run (pid "
                              f"{process.pid} on host {socket.gethostname()}, since ")
    assert message.endswith(f"lock file '{directory / LOCK_FILE}'): wait for it to end, or "
                            "choose another run.output_dir")
    # The ranks that do not lock refuse too, from the holder's record.
    with pytest.raises(RunDirectoryInUse, match=f"pid {process.pid} on host"):
        RunLock(directory, job="mine").check()
    # The holder's own launch carries on.
    RunLock(directory, job="other-job").check()


def test_the_lock_of_a_killed_run_is_taken_over_and_said_in_the_log(holder, caplog):
    directory, process = holder
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    RunLock(directory, job="mine").check()  # a dead holder's record refuses no one
    with RunLock(directory, job="mine") as lock:
        lock.acquire()
        record = json.loads((directory / LOCK_FILE).read_text())
        assert (record["holder"]["pid"], record["job"]) == (os.getpid(), "mine")
        with caplog.at_level(logging.WARNING, logger="mcore_refit"):
            lock.log_replaced()
    assert f"took over the lock of run.output_dir '{directory}' from pid {process.pid} on " \
           f"host {socket.gethostname()}, since " in caplog.text
    assert "which is no longer running" in caplog.text
    # A released lock leaves no record: the next run takes nothing over.
    assert (directory / LOCK_FILE).read_text() == ""
    with RunLock(directory, job="next") as lock:
        lock.acquire()
        assert lock.replaced is None


def test_the_lock_is_exclusive_within_one_host(tmp_path):
    with RunLock(tmp_path, job="a") as first:
        first.acquire()
        with pytest.raises(RunDirectoryInUse, match=f"pid {os.getpid()} on host"):
            RunLock(tmp_path, job="b").acquire()
    with RunLock(tmp_path, job="b") as second:  # free again once released
        second.acquire()
        assert second.held


@pytest.mark.parametrize("inside", [False, True])
def test_an_output_dir_that_is_a_file_names_the_key(tmp_path, inside):
    (tmp_path / "file").write_text("not a directory")
    directory = tmp_path / "file" / "run" if inside else tmp_path / "file"
    where = f"is inside '{tmp_path / 'file'}', which is" if inside else "is"
    message = f"run.output_dir='{directory}' {where} a file, not a directory; choose a directory"
    for action in (RunLock(directory, job="a").acquire, RunLock(directory, job="a").check):
        with pytest.raises(ConfigError) as error:
            action()
        assert str(error.value) == message
