"""torchrun --nproc-per-node 2 grpo_faults.py --fault F --config CFG --out DIR [overrides]

Runs the colocated GRPO loop with one fault injected:

- ``corrupt``: a weight source that shifts one tensor on its way to the engine; the
  trainer-vs-engine logprob agreement must expose it. Rank 0 writes ``DIR/summary.json``.
- ``kill_engine``: rank 1's engine process is SIGKILLed before the second refit;
- ``fail_connect``: connecting rank 0's engine raises (as when another trainer holds the device).

For the last two, every rank must raise the same error naming the failed rank, rather than wait
in a collective. Each rank writes the text of what it raised to ``DIR/rank<r>.txt``.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "recipes"))

import grpo  # noqa: E402  (the recipe module: build_trainer, train)

from mcore_refit import distributed  # noqa: E402
from mcore_refit.config import load_config  # noqa: E402
from mcore_refit.generation import ColocatedRollouts  # noqa: E402
from mcore_refit.grpo_config import GRPOJobConfig  # noqa: E402

# Short enough that a rank left waiting in a collective fails the test quickly, long enough for
# a refit of the tiny model on a loaded CPU.
COLLECTIVE_TIMEOUT_S = 90.0


class CorruptingSource:
    """Yields the wrapped source's tensors, with ``name`` shifted by ``delta``."""

    def __init__(self, source, *, name: str, delta: float) -> None:
        self._source, self._name, self._delta = source, name, delta

    def weight_specs(self):
        return self._source.weight_specs()

    def iter_weights(self):
        for name, tensor in self._source.iter_weights():
            yield name, (tensor + self._delta if name == self._name else tensor)


class EngineKillingRollouts(ColocatedRollouts):
    """On ``victim_rank``, kills the engine process before the refit to ``weight_version``."""

    def __init__(self, *, victim_rank: int, weight_version: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self._kill = (self._context.rank == victim_rank, weight_version)

    def refit(self, *, weight_version: int, verify: bool) -> dict:
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


def _rollouts(args, *, source, **common) -> ColocatedRollouts:
    if args.fault == "corrupt":
        corrupted = CorruptingSource(source, name=args.corrupt, delta=0.05)
        return ColocatedRollouts(source=corrupted, **common)
    if args.fault == "kill_engine":
        return EngineKillingRollouts(source=source, victim_rank=1, weight_version=1, **common)
    return ConnectFailingRollouts(source=source, victim_rank=0, **common)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=["corrupt", "kill_engine", "fail_connect"],
                        required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--corrupt", default="model.layers.0.mlp.down_proj.weight")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    config = load_config(GRPOJobConfig, args.config, args.overrides)
    context = distributed.init_distributed(rank=int(os.environ["RANK"]),
                                           world_size=int(os.environ["WORLD_SIZE"]),
                                           local_rank=int(os.environ["LOCAL_RANK"]),
                                           timeout_s=COLLECTIVE_TIMEOUT_S)
    raised = None
    try:
        policy, source, pad_token_id = grpo.build_trainer(config, context.device)
        rollouts = _rollouts(args, config=config, context=context, source=source,
                             job_id=f"faults-{os.getpid()}")
        try:
            summary = grpo.train(config, policy, rollouts, pad_token_id, context.device, False)
        finally:
            rollouts.close()
    except Exception as error:
        if args.fault == "corrupt":
            raise
        raised = f"{type(error).__name__}: {error}"
    finally:
        distributed.shutdown()
    if raised is not None:
        (args.out / f"rank{context.rank}.txt").write_text(raised)
    elif context.rank == 0:
        (args.out / "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
    assert not dist.is_initialized()
