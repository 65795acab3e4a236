"""Run a scenario function on several fresh gloo ranks and collect their results.

Each rank runs ``scenario(rank, *args)`` in a fresh process joined to a gloo default group on a
free port, and writes the returned JSON (or the uncaught error) to a file the test reads back.

The processes come from one fork server per test session that has imported torch and the
library once (``process_context``): a fresh process then costs a fork, not the seconds of those
imports, and still starts with no state of the test process (no process group, no engine).
"""

from __future__ import annotations

import datetime
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mcore_refit.logs import lock_progress_bars_within_the_process
from tests.launch import REPO_ROOT, free_port, launch_env, launch_failure, run_torchrun

# Imported once by the fork server; each process forked from it starts with them loaded
# (tests.preload: torch, the library, Megatron-Core and the bridges of the tests' models).
_PRELOAD = ["tests.preload"]

# How long the other ranks of a failed run_script launch get to end after SIGTERM before SIGKILL
# (torchrun's agent waits 30 s).
STOP_GRACE_S = 30

# The default group's own timeout: far above the bounded waits under test, so those fire first.
GROUP_TIMEOUT_S = 60


def _entry(scenario, rank: int, world: int, port: int, out_dir: str, args: tuple,
           release) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        result = scenario(rank, *args)
    except BaseException as error:  # reported to the test, which asserts on it
        result = {"uncaught": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc()}
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        release.wait(GROUP_TIMEOUT_S)  # rank 0 hosts the rendezvous store: leave last
    # Skip teardown: after a killed peer or a timeout the group cannot be destroyed cleanly.
    os._exit(0)


def process_context():
    """The multiprocessing context of the tests' fresh processes: the fork server, which imports
    ``_PRELOAD`` when it starts (at the first process of the session).

    A process from it carries the environment of the test process as it was when the server
    started, not as it is when the process starts: pass what a process needs as arguments.
    """
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def warm_fork_server() -> None:
    """Start the fork server and wait until it has done its imports (it forks a no-op)."""
    process = process_context().Process(target=int)
    process.start()
    process.join()


def run_ranks(scenario, world: int, tmp_path: Path, *args, timeout_s: float = 60) -> dict:
    """Run ``scenario(rank, *args)`` on ``world`` fresh gloo ranks; results by rank."""
    context = process_context()
    port = free_port()
    release = context.Event()
    processes = [context.Process(target=_entry,
                                 args=(scenario, rank, world, port, str(tmp_path), args, release))
                 for rank in range(world)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    for process in processes[1:]:
        process.join(max(0.0, deadline - time.monotonic()))
    release.set()
    processes[0].join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    assert not hung, f"ranks {hung} did not finish within {timeout_s}s"
    results = {}
    for rank in range(world):
        path = tmp_path / f"{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else None
    return results


def run_script(script: str | Path, *args: str, nproc: int, timeout_s: float,
               env: dict[str, str] | None = None, expect_failure: bool = False,
               cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    """Run ``script`` as ``torchrun --nproc-per-node nproc`` would, each rank forked from the fork
    server instead of a fresh interpreter (start-up without the seconds of imports): torchrun's
    variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) with the key-value
    store on ``MASTER_PORT`` hosted here as torchrun's agent hosts it, ``sys.argv``, the
    script's folder first on ``sys.path``, ``cwd`` as the working directory, and the exit code
    the script leaves with; as under torchrun, the first rank to fail stops the others (SIGTERM,
    then SIGKILL after :data:`STOP_GRACE_S`). ``env`` is added to each rank's environment (its
    ``PYTHONPATH`` to ``sys.path`` too: the rank's interpreter is already running). Raises with
    every rank's output on a failure (with ``expect_failure``, when it succeeds instead) or after
    ``timeout_s``.

    For scenario scripts, and for recipes where what the test claims is not about the launcher
    (a run's learning, parity, resume, a benchmark's figures, the error every rank of a failed
    run reports): a test of torchrun's behaviour, of signals or of what the terminal shows
    launches with :func:`tests.launch.run_torchrun`.
    A rank's launcher is the fork server here, which outlives the run. With CUDA, where the fork
    server must not hold a CUDA context for its children, it is torchrun too."""
    if torch.cuda.is_available():
        return run_torchrun(script, *args, nproc=nproc, timeout_s=timeout_s, env=env,
                            expect_failure=expect_failure, cwd=cwd)
    context = process_context()
    port = free_port()
    command = [f"<fork server> {script}", *args, f"({nproc} ranks)"]
    # The launcher's key-value store, as torchrun's agent hosts it: the ranks' env:// groups and
    # a non-colocated job's groups meet in it.
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    with tempfile.TemporaryDirectory(prefix="ranks") as logs:
        processes = []
        launch = {**launch_env(env), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                  "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                  "TORCHELASTIC_USE_AGENT_STORE": "True"}
        for rank in range(nproc):
            rank_env = {**launch, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            process = context.Process(target=_script_rank,
                                      args=(str(script), args, rank_env, str(cwd), logs))
            process.start()
            processes.append(process)
        deadline = time.monotonic() + timeout_s
        running, failed = list(processes), False
        while running and not failed and time.monotonic() < deadline:
            running = _still_running(running, until=deadline)
            failed = any(p.exitcode for p in processes if p not in running)  # torchrun stops
        timed_out = bool(running) and not failed
        if failed:  # torchrun's agent then: SIGTERM to the others, SIGKILL after a grace period
            for process in running:
                process.terminate()
            grace_end = min(deadline, time.monotonic() + STOP_GRACE_S)
            while running and time.monotonic() < grace_end:
                running = _still_running(running, until=grace_end)
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()
        outputs = [(Path(logs, f"{rank}.out"), Path(logs, f"{rank}.err"))
                   for rank in range(nproc)]
        stdout = "".join(out.read_text() for out, _ in outputs if out.exists())
        stderr = "".join(f"--- rank {rank} ---\n{err.read_text()}"
                         for rank, (_, err) in enumerate(outputs) if err.exists())
    del store
    codes = [p.exitcode for p in processes]
    if timed_out:
        raise launch_failure(command, f"did not finish within {timeout_s}s (exit codes {codes})",
                             stdout, stderr)
    if any(codes) != expect_failure:
        raise launch_failure(command, f"exit codes {codes}", stdout, stderr)
    return subprocess.CompletedProcess(command, next((c for c in codes if c), 0), stdout, stderr)


def _still_running(processes: list, *, until: float) -> list:
    """``processes`` less those that ended, after waiting (at most until the monotonic time
    ``until``) for at least one to end."""
    ended = wait([p.sentinel for p in processes], timeout=max(0.0, until - time.monotonic()))
    return [p for p in processes if p.sentinel not in ended]


def _script_rank(script: str, args: tuple, env: dict[str, str], cwd: str, logs: str) -> None:
    """One rank of :func:`run_script`: the script as ``__main__``, its output in ``logs``."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    rank = env["RANK"]
    for fd, name in ((1, f"{rank}.out"), (2, f"{rank}.err")):
        os.dup2(os.open(Path(logs, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    # The rank ends with os._exit, which unlinks no named semaphore: no multiprocessing lock for
    # progress bars (the launch's resource tracker would report it leaked).
    lock_progress_bars_within_the_process()
    sys.argv = [script, *args]
    sys.path[:0] = [str(Path(script).parent),
                    *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if isinstance(exit_.code, int) or exit_.code is None:
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
