"""Shared pieces of the policy scenario scripts (run under torchrun, imported by path).

Batches are deterministic functions of a seed, so every rank (and every launch) builds the same
ones. Results are written by rank 0 with ``torch.save`` for the tests to compare across launches.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from mcore_refit import distributed
from mcore_refit.config import ModelConfig, ParallelConfig
from mcore_refit.policy import OptimizerConfig, PackingConfig, PolicyConfig, SequenceBatch

# name -> (layout, world size it is meant for); "pp1" is the non-pipelined single-rank reference.
LAYOUTS = {
    "pp1": (ParallelConfig(), 1),
    "dp2": (ParallelConfig(), 2),
    "pp2": (ParallelConfig(pipeline=2), 2),
    "pp2_vpp2": (ParallelConfig(pipeline=2, virtual_pipeline=2), 2),
    "tp2": (ParallelConfig(tensor=2), 2),
    "tp2_pp2_vpp2": (ParallelConfig(tensor=2, pipeline=2, virtual_pipeline=2), 4),
    "ep2": (ParallelConfig(expert=2), 2),  # mixture-of-experts checkpoints only
}


def layout(name: str) -> ParallelConfig:
    """The layout called ``name``; raises if this launch has the wrong number of ranks for it."""
    import torch.distributed as dist

    parallel, world_size = LAYOUTS[name]
    if dist.get_world_size() != world_size:
        raise ValueError(f"layout {name} needs {world_size} ranks, this launch has "
                         f"{dist.get_world_size()}")
    return parallel

# Four micro-batches per step in every layout (so layouts run identical micro-batches), and a
# token budget that the first-fit packing alone would meet with fewer bins.
PACKING = PackingConfig(max_tokens_per_micro_batch=64, min_bin_count=4, bin_count_multiple=4)


def policy_config(*, clip_grad: float | None, use_distributed_optimizer: bool = False,
                  temperature: float = 1.0) -> PolicyConfig:
    return PolicyConfig(
        optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_schedule="cosine", lr_warmup_steps=1,
                                  lr_warmup_init=5e-4, lr_decay_steps=4, weight_decay=0.01,
                                  clip_grad=clip_grad,
                                  use_distributed_optimizer=use_distributed_optimizer),
        packing=PACKING,
        temperature=temperature,
    )


def init_from_env():
    return distributed.init_distributed(rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]),
                                        local_rank=int(os.environ["LOCAL_RANK"]), timeout_s=300)


def make_batch(seed: int, *, num_sequences: int = 8, max_len: int = 24, vocab_size: int = 128,
               device: torch.device) -> SequenceBatch:
    """Sequences of 4..max_len tokens; the loss counts the 'response' after a random prompt."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, max_len + 1, (num_sequences,), generator=generator)
    tokens = torch.randint(4, vocab_size, (num_sequences, max_len), generator=generator)
    prompt = (torch.rand(num_sequences, generator=generator) * (lengths - 2).float()).long() + 1
    positions = torch.arange(max_len).unsqueeze(0)
    loss_mask = ((positions >= prompt.unsqueeze(1)) & (positions < lengths.unsqueeze(1))).float()
    advantages = torch.randn(num_sequences, generator=generator)
    return SequenceBatch(tokens=tokens.to(device), lengths=lengths.to(device),
                         loss_mask=loss_mask.to(device),
                         fields={"advantages": advantages.to(device)})


def with_fields(batch: SequenceBatch, **fields: torch.Tensor) -> SequenceBatch:
    return dataclasses.replace(batch, fields={**batch.fields, **fields})


def model_config(hf_path: Path, dtype: str) -> ModelConfig:
    return ModelConfig(hf_path=str(hf_path), dtype=dtype, layer_spec="local")


def exported(policy) -> dict[str, torch.Tensor]:
    """Every exported HF tensor, copied to the CPU (collective)."""
    return {name: tensor.detach().cpu().clone() for name, tensor in policy.export_hf_weights()}


def metrics_dict(metrics) -> dict:
    return dataclasses.asdict(metrics)


def save(result: dict, path: Path) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        torch.save(result, path)
