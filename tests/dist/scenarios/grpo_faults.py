"""torchrun --nproc-per-node N grpo_faults.py --fault F --config CFG --out DIR [overrides]

Runs the GRPO loop with one fault injected. Colocated (2 ranks):

- ``corrupt``: a weight source that shifts one tensor on its way to the engine; the
  trainer-vs-engine logprob agreement must expose it. Rank 0 writes ``DIR/summary.json``.
- ``kill_engine``: rank 1's engine process is SIGKILLed before the second refit;
- ``fail_connect``: connecting rank 0's engine raises (as when another trainer holds the device).

Non-colocated (3 ranks: 2 trainers, 1 inference rank):

- ``misname_refit``: in the second refit, trainer rank 0's export names one tensor wrongly, so
  the broadcast aborts.

Except for ``corrupt``, every trainer rank must raise the same error naming the failed rank,
rather than wait in a collective, and the inference ranks must stop cleanly. Each trainer rank
writes the text of what it raised to ``DIR/rank<r>.txt``.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mcore_refit import distributed, non_colocated
from mcore_refit.config import load_config
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.grpo.job import build_trainer, train, trainer_control
from mcore_refit.grpo.rollouts import ColocatedRollouts, NonColocatedRollouts, serve_inference
from mcore_refit.refit import RefitTelemetry

# Short enough that a rank left waiting in a collective fails the test quickly, long enough for
# a refit of the tiny model on a loaded CPU.
COLLECTIVE_TIMEOUT_S = 90.0


class _Transformed:
    """A refit source whose pass hands every yielded ``(name, tensor)`` through ``change``."""

    def __init__(self, source, change) -> None:
        self._source, self._change = source, change

    def layout(self):
        return self._source.layout()

    def begin(self, plan):
        refit_pass = self._source.begin(plan)
        change = self._change

        class Pass:
            stable_tensors = False

            def exchange(self, buffer, *, timeout_s):
                refit_pass.exchange(buffer, timeout_s=timeout_s)

            def own_weights(self):
                for index, (name, tensor) in enumerate(refit_pass.own_weights()):
                    yield change(index, name, tensor)

        return Pass()


def corrupting(source, *, name: str, delta: float):
    """Shifts tensor ``name`` by ``delta`` on its way to the engine."""
    return _Transformed(source, lambda index, n, t: (n, t + delta if n == name else t))


class EngineKillingRollouts(ColocatedRollouts):
    """On ``victim_rank``, kills the engine process before the refit to ``weight_version``."""

    def __init__(self, *, victim_rank: int, weight_version: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self._kill = (self._context.rank == victim_rank, weight_version)

    def refit(self, *, weight_version: int, verify: bool) -> RefitTelemetry:
        if self._kill == (True, weight_version):
            os.kill(self.engine.pid, signal.SIGKILL)
            time.sleep(1.0)  # let the kill land before the trainer talks to the engine
        return super().refit(weight_version=weight_version, verify=verify)


class ConnectFailingRollouts(ColocatedRollouts):
    """Connecting the engine raises on ``victim_rank``."""

    def __init__(self, *, victim_rank: int, **kwargs) -> None:
        self._victim_rank = victim_rank
        super().__init__(**kwargs)

    def _connect(self, **kwargs) -> None:
        if self._context.rank == self._victim_rank:
            raise ValueError("injected connect failure")
        super()._connect(**kwargs)


class MisnamingRollouts(NonColocatedRollouts):
    """Trainer rank 0's export misnames its first tensor in the refit to ``weight_version``."""

    def __init__(self, *, source, weight_version: int, **kwargs) -> None:
        self._armed = False
        self._weight_version = weight_version

        def rename(index, name, tensor):
            return ("model.misnamed.weight" if self._armed and index == 0 else name), tensor

        super().__init__(source=_Transformed(source, rename), **kwargs)

    def refit(self, *, weight_version: int, verify: bool) -> RefitTelemetry:
        self._armed = self._lead and weight_version == self._weight_version
        return super().refit(weight_version=weight_version, verify=verify)


def _rollouts(args, *, source, **common) -> ColocatedRollouts:
    if args.fault == "corrupt":
        return ColocatedRollouts(source=corrupting(source, name=args.corrupt, delta=0.05),
                                 **common)
    if args.fault == "kill_engine":
        return EngineKillingRollouts(source=source, victim_rank=1, weight_version=1, **common)
    return ConnectFailingRollouts(source=source, victim_rank=0, **common)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", required=True,
                        choices=["corrupt", "kill_engine", "fail_connect", "misname_refit"])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--corrupt", default="model.layers.0.mlp.down_proj.weight")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    config = load_config(GRPOJobConfig, args.config, args.overrides)
    ranks = dict(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                 local_rank=int(os.environ["LOCAL_RANK"]))
    if args.fault == "misname_refit":
        run_non_colocated(args, config, **ranks)
    else:
        run_colocated(args, config, **ranks)


def run_colocated(args, config, *, rank: int, world_size: int, local_rank: int) -> None:
    context = distributed.init_distributed(rank=rank, world_size=world_size,
                                           local_rank=local_rank,
                                           timeout_s=COLLECTIVE_TIMEOUT_S)
    raised = None
    try:
        policy, pad_token_id = build_trainer(config, context.device)
        trainers = trainer_control(context.control_group, config)
        rollouts = _rollouts(args, config=config, context=context,
                             source=policy.weight_source(control=trainers),
                             job_id=f"faults-{os.getpid()}")
        try:
            summary = train(config, policy, rollouts, pad_token_id, context.device, trainers,
                            False)
        finally:
            rollouts.close()
    except Exception as error:
        if args.fault == "corrupt":
            raise
        raised = f"{type(error).__name__}: {error}"
    finally:
        distributed.shutdown()
    if raised is not None:
        (args.out / f"rank{rank}.txt").write_text(raised)
    elif rank == 0:
        (args.out / "summary.json").write_text(json.dumps(summary))


def run_non_colocated(args, config, *, rank: int, world_size: int, local_rank: int) -> None:
    job = non_colocated.init_non_colocated_job(
        rank=rank, world_size=world_size, local_rank=local_rank,
        num_inference_ranks=config.inference.num_ranks,
        store_host=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
        timeout_s=COLLECTIVE_TIMEOUT_S)
    raised = None
    try:
        if not job.is_trainer:
            serve_inference(config=config, job=job)
            return
        policy, pad_token_id = build_trainer(config, job.context.device)
        trainers = trainer_control(job.context.control_group, config)
        rollouts = MisnamingRollouts(config=config, job=job,
                                     source=policy.weight_source(control=trainers),
                                     weight_version=1)
        try:
            train(config, policy, rollouts, pad_token_id, job.context.device, trainers, False)
        finally:
            rollouts.close()
    except Exception as error:
        raised = f"{type(error).__name__}: {error}"
    finally:
        distributed.shutdown()
    (args.out / f"rank{rank}.txt").write_text(str(raised))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
    assert not dist.is_initialized()
