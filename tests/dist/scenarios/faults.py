"""torchrun --nproc-per-node N faults.py --fault F --config CFG --out DIR [overrides]

The GRPO job of ``recipes/grpo.py`` (same job functions, the config's own timeouts) with one
process killed by SIGKILL at a chosen moment of the second refit (weight version 1):

- ``engine_before`` / ``engine_during`` / ``engine_after`` (colocated, 2 ranks): trainer rank 1's
  engine process, before the refit starts, halfway through rank 1's export, or right after the
  refit (the next command is a generation);
- ``trainer_export`` (colocated or non-colocated): trainer rank 1 itself, halfway through its
  export;
- ``inference_broadcast`` (non-colocated): the first inference rank, while it loads the first
  buffer it received.

The killer writes ``DIR/kill.json`` (``{"t": unix time, "pid": ...}``) just before the kill;
every surviving rank writes ``DIR/rank<global rank>.json`` (``{"t", "error", "phases"}``: when
it had unwound, what it raised, first line first, and when its unwinding steps — closing the
rollouts, tearing down the process groups — began and ended) and exits 1. The test compares the
times.
"""

import argparse
import json
import os
import signal
import time
import traceback
from pathlib import Path

import torch

from mcore_refit import distributed
from mcore_refit.config import load_config
from mcore_refit.grpo import job, rollouts
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.inference.engine import InferenceEngine
from mcore_refit.interrupts import StopSignals
from mcore_refit.processes import Interrupted, Terminated, exit_after, root_failure

VERSION = 1  # the refit the fault strikes: the first one after a training step
PHASES: list[tuple[str, float, float]] = []  # (step of the unwinding, start, end), unix times


def timed(name: str, function):
    def run(*args, **kwargs):
        start = time.time()
        try:
            return function(*args, **kwargs)
        finally:
            PHASES.append((name, start, time.time()))

    return run


def kill(pid: int, out: Path, what: str) -> None:
    (out / "kill.json").write_text(json.dumps({"t": time.time(), "pid": pid, "what": what}))
    os.kill(pid, signal.SIGKILL)
    if pid == os.getpid():
        time.sleep(60)  # SIGKILL is not delivered synchronously: never run on


class _Hooked:
    """A refit source whose pass calls ``hook(index)`` before yielding the own tensor at
    ``index``."""

    def __init__(self, source, hook) -> None:
        self._source, self._hook = source, hook

    def layout(self):
        return self._source.layout()

    def begin(self, plan):
        refit_pass, hook = self._source.begin(plan), self._hook

        class Pass:
            stable_tensors = False

            def exchange(self, buffer, *, timeout_s):
                refit_pass.exchange(buffer, timeout_s=timeout_s)

            def own_weights(self):
                for index, item in enumerate(refit_pass.own_weights()):
                    hook(index)
                    yield item

        return Pass()


def faulty_colocated(fault: str, out: Path):
    class FaultyColocated(rollouts.ColocatedRollouts):
        def __init__(self, *, source, context, **kwargs) -> None:
            self._version = 0
            self._victim = context.rank == 1
            super().__init__(source=_Hooked(source, self._on_export), context=context, **kwargs)

        def _on_export(self, index: int) -> None:
            if self._victim and self._version == VERSION and index == 3:
                if fault == "engine_during":
                    kill(self.engine.pid, out, "engine of trainer rank 1")
                elif fault == "trainer_export":
                    kill(os.getpid(), out, "trainer rank 1")

        def refit(self, *, weight_version: int, verify: bool) -> dict:
            self._version = weight_version
            if self._victim and weight_version == VERSION and fault == "engine_before":
                kill(self.engine.pid, out, "engine of trainer rank 1")
            result = super().refit(weight_version=weight_version, verify=verify)
            if self._victim and weight_version == VERSION and fault == "engine_after":
                kill(self.engine.pid, out, "engine of trainer rank 1")
            return result

    return FaultyColocated


def faulty_dedicated(fault: str, out: Path):
    class FaultyDedicated(rollouts.NonColocatedRollouts):
        def __init__(self, *, source, job, **kwargs) -> None:
            self._version = 0
            self._victim = job.context.rank == 1
            super().__init__(source=_Hooked(source, self._on_export), job=job, **kwargs)

        def _on_export(self, index: int) -> None:
            if (self._victim and self._version == VERSION and index == 3
                    and fault == "trainer_export"):
                kill(os.getpid(), out, "trainer rank 1")

        def refit(self, *, weight_version: int, verify: bool) -> dict:
            self._version = weight_version
            return super().refit(weight_version=weight_version, verify=verify)

    return FaultyDedicated


def arm_inference_rank(out: Path) -> None:
    """The inference rank kills itself while it loads the first buffer of refit VERSION."""
    receive = rollouts.receive_weight_update
    load = InferenceEngine.load_weights
    armed = [False]

    def receive_weight_update(endpoint, engine, weight_version):
        armed[0] = weight_version == VERSION
        return receive(endpoint, engine, weight_version)

    def load_weights(self, weights):
        if armed[0]:
            kill(os.getpid(), out, "inference rank 0")
        return load(self, weights)

    rollouts.receive_weight_update = receive_weight_update
    InferenceEngine.load_weights = load_weights


def report_failure(path: Path, error: BaseException) -> None:
    """Write this rank's report of ``error`` to ``path``; stop signals go unanswered from here on.

    The launcher sends SIGTERM to every rank as soon as one exited. StopSignals raises the first
    one in the main thread, at whatever line it runs then: here too, before the report is
    written, if this rank failed on its own (a peer's death) just before. Such a late stop is
    reported for what it interrupted, the failure it arrived during (``root_failure``)."""
    while True:
        try:
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, signal.SIG_IGN)
            reported = root_failure(error)  # what the recipe's traceback shows first
            path.write_text(json.dumps(
                {"t": time.time(), "error": f"{type(reported).__name__}: {reported}",
                 "traceback": "".join(traceback.format_exception(error)), "phases": PHASES}))
            return
        except (Terminated, Interrupted) as late:  # raised once at most (StopSignals)
            error = late


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", required=True,
                        choices=["engine_before", "engine_during", "engine_after",
                                 "trainer_export", "inference_broadcast"])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--job-id", default=None, help="names the CPU engines' IPC files")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    config = load_config(GRPOJobConfig, args.config, args.overrides)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = dict(local_rank=int(os.environ["LOCAL_RANK"]),
                 local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]))
    distributed.shutdown = timed("shutdown", distributed.shutdown)
    for backend in (rollouts.ColocatedRollouts, rollouts.NonColocatedRollouts):
        backend.close = timed("close", backend.close)
    with StopSignals(announce=rank == 0) as stops:
        try:
            if config.refit.mode == "colocated":
                job.ColocatedRollouts = faulty_colocated(args.fault, args.out)
                job.run_colocated(config, rank=rank, world_size=world_size, **local,
                                  job_id=args.job_id or f"faults-{os.environ['MASTER_PORT']}",
                                  resume=False, stops=stops)
            else:
                job.NonColocatedRollouts = faulty_dedicated(args.fault, args.out)
                if args.fault == "inference_broadcast":
                    arm_inference_rank(args.out)
                job.run_non_colocated(config, rank=rank, world_size=world_size, **local,
                                      resume=False,
                                      store_host=os.environ["MASTER_ADDR"],
                                      store_port=int(os.environ["MASTER_PORT"]), stops=stops)
        except BaseException as error:  # Terminated included: report it like any failure
            report_failure(args.out / f"rank{rank}.json", error)
            raise
    (args.out / f"rank{rank}.json").write_text(json.dumps({"t": time.time(), "error": None}))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    exit_after(main)  # as recipes/grpo.py: a failed rank leaves at once
