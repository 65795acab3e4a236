"""Run a scenario function on several fresh gloo ranks and collect their results.

Each rank runs ``scenario(rank, *args)`` in a fresh process joined to a gloo default group on a
free port, and writes the returned JSON (or the uncaught error) to a file the test reads back.

The processes come from one fork server per test session that has imported torch and the
library once (``start_process``): a fresh process then costs a fork, not the seconds of those
imports, and still starts with no state of the test process (no process group, no engine).
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.launch import free_port

# Imported once by the fork server; each process forked from it starts with them loaded.
_PRELOAD = ["torch", "torch.distributed", "mcore_refit.refit", "mcore_refit.control",
            "mcore_refit.bench.synthetic", "zmq"]

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
