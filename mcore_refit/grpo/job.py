"""Running a GRPO job: process groups, the trainer, the rollouts backend, the loop.

:func:`run_colocated` and :func:`run_non_colocated` are what ``recipes/grpo.py`` calls with
torchrun's ranks; both return the summary on every trainer rank (None on inference ranks) and
tear the process groups down however the run ends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_refit import distributed
from mcore_refit.control import ControlGroup
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.grpo.loop import run_grpo
from mcore_refit.grpo.rollouts import ColocatedRollouts, DedicatedRollouts, serve_inference
from mcore_refit.inference.engine import pad_token_id
from mcore_refit.policy.worker import Policy, build_policy
from mcore_refit.refit.export import ModelExport


def run_colocated(config: GRPOJobConfig, *, rank: int, world_size: int, local_rank: int,
                  local_world_size: int, job_id: str, resume: bool) -> dict:
    """Every rank trains and refits an engine process on its own device."""
    context = distributed.init_distributed(rank=rank, world_size=world_size,
                                           local_rank=local_rank,
                                           local_world_size=local_world_size,
                                           timeout_s=config.collective_timeout_s)
    try:
        policy, pad_token_id = build_trainer(config, context.device)
        source = weight_source(policy, context.control_group, config, context.device)
        rollouts = ColocatedRollouts(config=config, context=context, source=source,
                                     job_id=job_id)
        try:
            return train(config, policy, rollouts, pad_token_id, context.device, resume)
        finally:
            rollouts.close()
    finally:
        distributed.shutdown()


def run_non_colocated(config: GRPOJobConfig, *, rank: int, world_size: int, local_rank: int,
                      local_world_size: int, resume: bool, store_host: str,
                      store_port: int) -> dict | None:
    """The last ``inference.num_ranks`` ranks serve inference; the others train and refit them."""
    job = distributed.init_split_job(rank=rank, world_size=world_size, local_rank=local_rank,
                                     local_world_size=local_world_size,
                                     num_inference_ranks=config.inference.num_ranks,
                                     store_host=store_host, store_port=store_port,
                                     timeout_s=config.collective_timeout_s)
    try:
        if not job.is_trainer:
            serve_inference(config=config, job=job)
            return None
        policy, pad_token_id = build_trainer(config, job.context.device)
        # A trainer rank on an inference rank's device hands its buffers over without a link.
        prefer = {trainer for trainer, _ in job.placement.shared}
        source = weight_source(policy, job.context.control_group, config, job.context.device,
                               prefer=prefer)
        rollouts = DedicatedRollouts(config=config, job=job, source=source)
        try:
            return train(config, policy, rollouts, pad_token_id, job.context.device, resume)
        finally:
            rollouts.close()
    finally:
        distributed.shutdown()


def build_trainer(config: GRPOJobConfig, device: torch.device) -> tuple[Policy, int]:
    """Megatron's groups, the policy and the tokenizer's pad token, EOS when it has none
    (every trainer rank)."""
    from transformers import AutoTokenizer

    model_parallel = distributed.init_model_parallel(config.parallel, seed=config.run.seed)
    policy = build_policy(config.model, model_parallel, config.policy, device=device)
    tokenizer = AutoTokenizer.from_pretrained(config.model.hf_path)
    return policy, pad_token_id(tokenizer, where=config.model.hf_path)


def weight_source(policy: Policy, control_group: dist.ProcessGroup, config: GRPOJobConfig,
                  device: torch.device, *, prefer=()) -> ModelExport:
    """The refit's source: each trainer rank exports the weights it holds (collective)."""
    control = ControlGroup(control_group, timeout_s=config.collective_timeout_s,
                           name="the trainer ranks' control group")
    return policy.weight_source(control=control, prefer=prefer)


def train(config: GRPOJobConfig, policy: Policy, rollouts, pad_token_id: int,
          device: torch.device, resume: bool) -> dict:
    return run_grpo(config, policy=policy, rollouts=rollouts, pad_token_id=pad_token_id,
                    device=device, is_logging_rank=dist.get_rank() == 0, resume=resume)
