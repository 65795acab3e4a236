"""GRPO with the refit engine in the loop, colocated or non-colocated.

    torchrun --nproc-per-node N recipes/grpo.py --config configs/X.yaml [key=value ...] [--resume]

Colocated (refit.mode: colocated): every rank trains and spawns an inference engine on its own
device. Non-colocated: the last inference.num_ranks ranks serve inference on their own devices.
The last line of stdout (global rank 0) is the run's summary as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML file (see configs/)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in run.output_dir")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)

    from mcore_refit.config import load_config
    from mcore_refit.grpo_config import GRPOJobConfig

    config = load_config(GRPOJobConfig, args.config, args.overrides)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if config.refit.mode == "colocated":
        summary = run_colocated(config, rank=rank, world_size=world_size, local_rank=local_rank,
                                job_id=_job_id(),
                                resume=args.resume)
    else:
        summary = run_non_colocated(config, rank=rank, world_size=world_size,
                                    local_rank=local_rank, resume=args.resume,
                                    store_host=os.environ["MASTER_ADDR"],
                                    store_port=int(os.environ["MASTER_PORT"]))
    if rank == 0:
        print(json.dumps(summary), flush=True)
    return 0


def _job_id() -> str:
    """Unique among the jobs running on this host (names the CPU engines' sockets).

    A plain ``torchrun`` leaves TORCHELASTIC_RUN_ID at "none"; the rendezvous port tells
    concurrent jobs apart.
    """
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'grpo')}-{os.environ['MASTER_PORT']}"


def run_colocated(config, *, rank, world_size, local_rank, job_id, resume) -> dict | None:
    from mcore_refit import distributed
    from mcore_refit.generation import ColocatedRollouts

    context = distributed.init_distributed(rank=rank, world_size=world_size,
                                           local_rank=local_rank,
                                           timeout_s=config.collective_timeout_s)
    try:
        policy, source, pad_token_id = build_trainer(config, context.device)
        rollouts = ColocatedRollouts(config=config, context=context, source=source,
                                     job_id=job_id)
        try:
            return train(config, policy, rollouts, pad_token_id, context.device, resume)
        finally:
            rollouts.close()
    finally:
        distributed.shutdown()


def run_non_colocated(config, *, rank, world_size, local_rank, resume, store_host,
                      store_port) -> dict | None:
    from mcore_refit import distributed
    from mcore_refit.generation import DedicatedRollouts, serve_inference

    job = distributed.init_split_job(rank=rank, world_size=world_size, local_rank=local_rank,
                                     num_inference_ranks=config.inference.num_ranks,
                                     store_host=store_host, store_port=store_port,
                                     timeout_s=config.collective_timeout_s)
    try:
        if not job.is_trainer:
            serve_inference(config=config, job=job)
            return None
        policy, source, pad_token_id = build_trainer(config, job.context.device)
        rollouts = DedicatedRollouts(config=config, job=job, source=source)
        try:
            return train(config, policy, rollouts, pad_token_id, job.context.device, resume)
        finally:
            rollouts.close()
    finally:
        distributed.shutdown()


def build_trainer(config, device):
    from transformers import AutoTokenizer

    from mcore_refit import distributed
    from mcore_refit.policy.worker import build_policy
    from mcore_refit.refit.source import BridgeWeightSource

    distributed.init_model_parallel(config.parallel, seed=config.run.seed)
    policy = build_policy(config.model, config.parallel, config.policy, device=device)
    pad_token_id = AutoTokenizer.from_pretrained(config.model.hf_path).pad_token_id
    return policy, BridgeWeightSource(policy.model), pad_token_id


def train(config, policy, rollouts, pad_token_id, device, resume) -> dict:
    import torch.distributed as dist

    from mcore_refit.grpo_loop import run_grpo

    return run_grpo(config, policy=policy, rollouts=rollouts, pad_token_id=pad_token_id,
                    device=device, is_logging_rank=dist.get_rank() == 0, resume=resume)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
