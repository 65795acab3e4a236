"""Owner records of the IPC files and the start-up sweep: a dead job's files go, a live job's
stay (whoever runs the sweep), and files without records are removed only when nothing holds
them."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mcore_refit.processes import ProcessIdentity, pid_running
from mcore_refit.refit.transports.ipc_files import claim_owner, sweep_stale_files

REPO_ROOT = Path(__file__).resolve().parents[2]

# Another process that owns KEY's files the way a trainer does: its owner record locked, then
# its socket and slots created. It prints "ready" and sleeps until killed.
_OWNER = textwrap.dedent("""
    import fcntl, os, socket, sys, time
    directory, key = sys.argv[1], sys.argv[2]
    fd = os.open(f"{directory}/{key}.owner", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b'{"pid": %d}' % os.getpid())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{directory}/{key}.sock")
    listener.listen()
    for index in range(2):
        open(f"{directory}/{key}.slot{index}", "wb").write(b"x" * 64)
    print("ready", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def owner_process(tmp_path):
    started = []

    def start(key):
        process = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path), key],
                                   stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline().strip() == "ready"
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def names(directory):
    return sorted(path.name for path in directory.iterdir())


def test_a_dead_owners_files_are_removed_and_a_live_owners_kept(tmp_path, owner_process):
    live = owner_process("live-rank0")
    dead = owner_process("dead-rank0")
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait()
    removed = sweep_stale_files(tmp_path)
    assert sorted(path.name for path in removed) == [
        "dead-rank0.owner", "dead-rank0.slot0", "dead-rank0.slot1", "dead-rank0.sock"]
    assert names(tmp_path) == ["live-rank0.owner", "live-rank0.slot0", "live-rank0.slot1",
                               "live-rank0.sock"]
    assert live.poll() is None


def test_claiming_a_live_owners_key_is_refused_and_a_dead_owners_key_is_taken(tmp_path,
                                                                              owner_process):
    live = owner_process("gpu-a")
    with pytest.raises(ValueError, match=r"gpu-a\.owner belongs to a live process "
                                         rf"\(\{{\"pid\": {live.pid}\}}\): another trainer"):
        claim_owner(tmp_path, "gpu-a")
    live.kill()
    live.wait()
    record = claim_owner(tmp_path, "gpu-a")
    assert f'"pid": {os.getpid()}' in (tmp_path / "gpu-a.owner").read_text()
    # Our own record is ours: a sweep (here, by this same process) keeps it.
    assert "gpu-a.owner" not in [path.name for path in sweep_stale_files(tmp_path)]
    record.release()
    assert not (tmp_path / "gpu-a.owner").exists()
    record.release()  # idempotent


def test_files_without_owner_records_go_only_when_nothing_holds_them(tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "old-live.sock"))
    listener.listen()
    (tmp_path / "old-live.slot0").write_bytes(b"x")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / "old-dead.sock"))
    dead.close()  # bound, never listening: as a socket file left by a process that died
    (tmp_path / "old-dead.slot0").write_bytes(b"x")
    (tmp_path / "orphan.slot3").write_bytes(b"x")
    (tmp_path / "shared.weights0").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("not ours")
    try:
        removed = sweep_stale_files(tmp_path)
    finally:
        listener.close()
    assert sorted(path.name for path in removed) == ["old-dead.slot0", "old-dead.sock",
                                                     "orphan.slot3"]
    assert names(tmp_path) == ["notes.txt", "old-live.slot0", "old-live.sock",
                               "shared.weights0"]


def test_a_reused_pid_is_not_the_process_that_died():
    me = ProcessIdentity.of()
    assert me.gone() is False and me.start_time is not None
    assert pid_running(os.getpid(), start_time=me.start_time)
    impostor = ProcessIdentity(host=me.host, pid=me.pid, start_time=me.start_time + 1)
    assert impostor.gone() is True
    assert ProcessIdentity(host=me.host + "-elsewhere", pid=1, start_time=None).gone() is None
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert ProcessIdentity.of(child.pid).gone() is True


# Sweeps ``directory`` without pause for ``seconds``; prints the names of what it removed.
# Sweeps DIRECTORY over and over, printing what it removes, for at most SECONDS or until the
# file STOP exists (checked between whole sweeps).
_SWEEPER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from mcore_refit.refit.transports.ipc_files import sweep_stale_files
    directory, seconds, stop = Path(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stop.exists():
        for path in sweep_stale_files(directory):
            print(path.name, flush=True)
""")


def test_a_sweep_racing_a_claim_never_removes_the_live_owners_record(tmp_path):
    """The claim is never visible unlocked: a sweep at any moment sees a live owner."""
    directory, stop = tmp_path / "ipc", tmp_path / "stop"
    directory.mkdir()
    sweeper = subprocess.Popen([sys.executable, "-c", _SWEEPER, str(directory), "10", str(stop)],
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert sweeper.stdout.readline() == "ready\n"
    claims = 0
    while sweeper.poll() is None and claims < 1000:
        record = claim_owner(directory, "gpu-a")
        assert record.path.exists()
        record.release()
        claims += 1
    stop.touch()  # the race is over: the sweeper ends after its current sweep, not in 10 s
    removed, _ = sweeper.communicate()
    assert claims >= 300
    assert removed == "", f"the sweep removed a live claim's files: {removed.split()}"
    assert names(directory) == []
