"""Launch multi-process scenarios under torchrun from tests, with a free port and a timeout."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# An environment variable that marks every process of one launch (see launched_processes).
LAUNCH_TAG = "MCORE_REFIT_TEST_LAUNCH"
# How long a process of a launch that outlived its timeout gets to print its stacks and end.
DUMP_WAIT_S = 3.0


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(script: str | Path, *args: str, nproc: int, timeout_s: float,
                 env: dict[str, str] | None = None,
                 standalone: bool = False,
                 expect_failure: bool = False,
                 cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun with ``nproc`` ranks in ``cwd``; raise with its output on
    failure (with ``expect_failure``, when it succeeds instead).

    The rendezvous is on a free port, or, with ``standalone``, torchrun's own ``--standalone``
    (it picks a free port and a unique run id itself, as ``make demo`` does).
    """
    rendezvous = (["--standalone"] if standalone
                  else ["--master-addr=127.0.0.1", f"--master-port={free_port()}"])
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               *rendezvous, str(script), *args]
    tag = uuid.uuid4().hex
    process = subprocess.Popen(command, cwd=cwd, env=launch_env(env, tag=tag),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_no_core_dumps)
    return _finish(process, command, timeout_s, tag=tag, expect_failure=expect_failure)


def run_torchrun_nodes(script: str | Path, *args: str, num_nodes: int, nproc_per_node: int,
                       timeout_s: float,
                       env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``script`` as a multi-node job on this host: one torchrun agent per node
    (``--nnodes``, ``--node-rank``), all meeting at one rendezvous endpoint on a free port.
    Returns each node's result (node 0's stdout holds global rank 0's)."""
    port = free_port()
    commands = [[sys.executable, "-m", "torch.distributed.run", f"--nnodes={num_nodes}",
                 f"--node-rank={node}", f"--nproc-per-node={nproc_per_node}",
                 "--master-addr=127.0.0.1", f"--master-port={port}", str(script), *args]
                for node in range(num_nodes)]
    deadline = time.monotonic() + timeout_s
    tag = uuid.uuid4().hex
    with contextlib.ExitStack() as stack:
        # Files, not pipes: an agent must never block on output nobody reads yet.
        outputs = [(stack.enter_context(tempfile.TemporaryFile("w+")),
                    stack.enter_context(tempfile.TemporaryFile("w+"))) for _ in commands]
        processes = [subprocess.Popen(command, cwd=REPO_ROOT, env=launch_env(env, tag=tag),
                                      stdout=out, stderr=err, text=True,
                                      preexec_fn=_no_core_dumps)
                     for command, (out, err) in zip(commands, outputs, strict=True)]
        try:
            for process in processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            if any(process.poll() is None for process in processes):
                dump_stacks(tag)
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        results = []
        for command, process, (out, err) in zip(commands, processes, outputs, strict=True):
            out.seek(0)
            err.seek(0)
            results.append(subprocess.CompletedProcess(command, process.returncode, out.read(),
                                                       err.read()))
    for result in results:
        if result.returncode != 0:
            raise launch_failure(result.args, f"exited with {result.returncode} (killed after "
                                        f"{timeout_s}s if negative)", result.stdout, result.stderr)
    return results


def launch_env(env: dict[str, str] | None, *, tag: str | None = None) -> dict[str, str]:
    """The environment of a launch's processes: this one's, unbuffered, one OpenMP thread,
    ``env``, and with a ``tag``, that tag (see :func:`launched_processes`) and Python's fault
    handler (SIGABRT prints every thread's stack: :func:`dump_stacks`)."""
    tagged = {} if tag is None else {LAUNCH_TAG: tag, "PYTHONFAULTHANDLER": "1"}
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **tagged,
            **(env or {})}


def dump_stacks(tag: str) -> None:
    """Make every live process of the launch tagged ``tag`` print the stacks of all its threads
    on its stderr and end (SIGABRT, under ``PYTHONFAULTHANDLER``): what a launch that outlived
    its timeout was waiting for, in its own output.

    All of them are stopped first and then dumped one at a time, so that no block of stacks is
    interleaved with another's and no process reacts to another's end (torchrun stopping its
    ranks) before printing its own."""
    pids = launched_processes(tag)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGSTOP)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGABRT)
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + DUMP_WAIT_S
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    for pid in launched_processes(tag):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and has not yet ended (a zombie has)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _no_core_dumps() -> None:
    """In a launch's first process, before it runs (inherited by all it starts): the SIGABRT of
    :func:`dump_stacks` leaves no core file behind."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _finish(process: subprocess.Popen, command: list[str], timeout_s: float, *, tag: str,
            expect_failure: bool = False) -> subprocess.CompletedProcess:
    """Wait for ``process``; raise with its output if it outlives ``timeout_s`` (with every
    thread's stack of every process of the launch ``tag``), or if it fails (with
    ``expect_failure``, if it succeeds instead)."""
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        dump_stacks(tag)
        process.kill()
        stdout, stderr = process.communicate()
        raise launch_failure(command, f"did not finish within {timeout_s}s (the stacks of its "
                             "processes at that moment end its stderr)", stdout, stderr,
                             tail_chars=60000) from None
    if (process.returncode != 0) != expect_failure:
        raise launch_failure(command, f"exited with {process.returncode}", stdout, stderr)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def launch_failure(command: list[str], what: str, stdout: str, stderr: str, *,
                   tail_chars: int = 10000) -> AssertionError:
    """The error of a launch that went wrong: the command, what happened, its output's tail."""
    return AssertionError(f"{' '.join(command)} {what}\n--- stdout ---\n{stdout[-10000:]}\n"
                          f"--- stderr ---\n{stderr[-tail_chars:]}")


def last_json_line(stdout: str) -> dict:
    """The JSON object on the last non-empty line of ``stdout``."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise AssertionError("no output")
    return json.loads(lines[-1])


def launched_processes(tag):
    """Pids of the live processes whose environment carries ``LAUNCH_TAG=tag`` (a launch's
    torchrun and everything it started, orphans included)."""
    needle = f"{LAUNCH_TAG}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            tagged = needle in (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if tagged and _running(int(entry.name)):
            pids.append(int(entry.name))
    return pids
