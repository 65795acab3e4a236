"""torchrun --nproc-per-node 2 grpo_corrupted_refit.py --config CFG --out RESULT.json [overrides]

Runs the colocated GRPO loop with a weight source that perturbs one tensor on its way to the
engine: the trainer-vs-engine logprob agreement must expose it. Rank 0 writes the summary.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "recipes"))

import grpo  # noqa: E402  (the recipe module: build_trainer, train)


class CorruptingSource:
    """Yields the wrapped source's tensors, with ``name`` shifted by ``delta``."""

    def __init__(self, source, *, name: str, delta: float) -> None:
        self._source, self._name, self._delta = source, name, delta

    def weight_specs(self):
        return self._source.weight_specs()

    def iter_weights(self):
        for name, tensor in self._source.iter_weights():
            yield name, (tensor + self._delta if name == self._name else tensor)


def main():
    import os

    from mcore_refit import distributed
    from mcore_refit.config import load_config
    from mcore_refit.generation import ColocatedRollouts
    from mcore_refit.grpo_config import GRPOJobConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--corrupt", default="model.layers.0.mlp.down_proj.weight")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    config = load_config(GRPOJobConfig, args.config, args.overrides)
    context = distributed.init_distributed(rank=int(os.environ["RANK"]),
                                           world_size=int(os.environ["WORLD_SIZE"]),
                                           local_rank=int(os.environ["LOCAL_RANK"]))
    try:
        policy, source, pad_token_id = grpo.build_trainer(config, context.device)
        corrupted = CorruptingSource(source, name=args.corrupt, delta=0.05)
        rollouts = ColocatedRollouts(config=config, context=context, source=corrupted,
                                     job_id=f"corrupt-{os.getpid()}")
        try:
            summary = grpo.train(config, policy, rollouts, pad_token_id, context.device, False)
        finally:
            rollouts.close()
    finally:
        distributed.shutdown()
    if context.rank == 0:
        Path(args.out).write_text(json.dumps(summary))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
    assert not dist.is_initialized()
