"""Stopping a GRPO launch from outside (README, "Faults"): SIGINT or SIGTERM to torchrun during
the start-up or mid-run, and ``kill -9`` of the torchrun agent. Every rank and engine process
must be gone within 5 s, with one line saying that the run was interrupted and no error blamed
on a rank; torchrun itself takes a few seconds more to exit (its own teardown: 2.7-5.9 s on the
loaded 2-core machine with ranks that only sleep). Each case prints its measured seconds.
"""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint
from tests.launch import LAUNCH_TAG, REPO_ROOT, launch_env, launched_processes

RECIPE = REPO_ROOT / "recipes" / "grpo.py"
COLOCATED = REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml"
BOUND_S = 5.0
LAUNCH_BOUND_S = 15.0
# Our code's frames in a traceback (torchrun prints its own SignalException's).
OUR_TRACEBACK = re.compile(r'File ".*/(mcore_refit|recipes)/')


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("interrupts") / "tiny-llama",
                                 TinyModelSpec(num_layers=4))


def stop_launch(checkpoint, out: Path, *, when: str,
                signum: int) -> tuple[float, float, str, int]:
    """Launch the colocated recipe (2 ranks, an engine each), send ``signum`` to torchrun
    ``when`` ("start-up": every rank has configured its log; "mid-run": a step is done) and
    return the seconds until every rank and engine (and their helpers) was gone, until
    torchrun was too, the launch's stderr, and torchrun's pid. Leftovers are killed (and fail
    the caller's bound)."""
    tag = uuid.uuid4().hex
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(RECIPE), "--config", str(COLOCATED),
               f"model.hf_path={checkpoint}", f"run.output_dir={out}", "run.steps=1000",
               "eval=null", "run.eval_every=0", "grpo.prompts_per_step=4",
               "grpo.samples_per_prompt=4"]
    env = launch_env({LAUNCH_TAG: tag})
    stderr = out.parent / f"{out.name}.stderr"
    with stderr.open("w") as errors:
        # A session of its own, as from a terminal: the signal reaches torchrun only.
        launch = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                                  stderr=errors, start_new_session=True)
        try:
            deadline = time.monotonic() + 400
            while not _reached(out, when):
                assert launch.poll() is None, f"the launch ended early:\n{stderr.read_text()}"
                assert time.monotonic() < deadline, f"never reached {when}"
                time.sleep(0.05)
            names = {pid: _name(pid) for pid in launched_processes(tag)}
            stopped = time.monotonic()
            os.kill(launch.pid, signum)
            gone = {}
            while time.monotonic() - stopped < 60:
                alive = set(launched_processes(tag))
                gone.update({pid: time.monotonic() - stopped for pid in names
                             if pid not in alive and pid not in gone})
                if not alive:
                    break
                time.sleep(0.05)
            launched_s = time.monotonic() - stopped
            ours_s = max((t for pid, t in gone.items() if pid != launch.pid), default=launched_s)
            print("gone after:", ", ".join(f"{names[pid]} {t:.2f} s"
                                           for pid, t in sorted(gone.items(), key=lambda x: x[1])))
        finally:
            for pid in launched_processes(tag):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            launch.kill()
            launch.wait()
    return ours_s, launched_s, stderr.read_text(), launch.pid


def _name(pid: int) -> str:
    """A launched process's role, from its command line."""
    with contextlib.suppress(OSError):
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        for role, needle in (("torchrun", b"torch.distributed.run"), ("rank", b"grpo.py"),
                             ("engine", b"spawn_main"), ("tracker", b"resource_tracker")):
            if any(needle in part for part in command):
                return f"{role}({pid})"
    return f"pid {pid}"


def _reached(out: Path, when: str) -> bool:
    if when == "start-up":
        return all((out / "logs" / f"rank{rank}.log").exists() for rank in range(2))
    metrics = out / "metrics.jsonl"
    return metrics.exists() and metrics.read_text().count("\n") >= 1


def check_interrupted(stderr: str, line: str) -> None:
    # Rank 0's line may follow its progress bar (no newline before it).
    said = [text[text.index("Interrupted:"):] for text in re.split(r"[\r\n]", stderr)
            if "Interrupted:" in text]
    assert said == [line], stderr[-6000:]
    assert "PeerDied" not in stderr and not OUR_TRACEBACK.search(stderr), stderr[-6000:]
    assert "leaked semaphore" not in stderr, stderr[-6000:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("when,signum", [("start-up", signal.SIGINT), ("mid-run", signal.SIGINT),
                                         ("mid-run", signal.SIGTERM)],
                         ids=["sigint-start-up", "sigint-mid-run", "sigterm-mid-run"])
def test_an_interrupt_ends_every_process_with_one_line(when, signum, checkpoint, tmp_path):
    seconds, launch_s, stderr, _ = stop_launch(checkpoint, tmp_path / "run", when=when,
                                               signum=signum)
    name = signal.Signals(signum).name
    print(f"{name} to torchrun {when}: every rank and engine gone {seconds:.2f} s later, "
          f"torchrun {launch_s:.2f} s")
    check_interrupted(stderr, f"Interrupted: the run was stopped by {name}")
    assert seconds <= BOUND_S
    assert launch_s <= LAUNCH_BOUND_S


@pytest.mark.timeout(600)
def test_no_process_outlives_a_killed_torchrun_agent(checkpoint, tmp_path):
    seconds, _, stderr, agent = stop_launch(checkpoint, tmp_path / "run", when="mid-run",
                                            signum=signal.SIGKILL)
    print(f"kill -9 of the torchrun agent mid-run: every rank and engine gone {seconds:.2f} s "
          "later")
    check_interrupted(stderr, f"Interrupted: the run was stopped: its launcher (pid {agent} on "
                              f"{socket.gethostname()}) died")
    assert seconds <= BOUND_S
