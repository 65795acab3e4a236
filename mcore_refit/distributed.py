"""Process groups for one job: torch.distributed, Megatron's model-parallel state, RNG seeds.

Library code never reads the environment; recipes read torchrun's variables and pass them in.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_refit import compat
from mcore_refit.config import ParallelConfig


@dataclass(frozen=True, kw_only=True)
class DistributedContext:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def init_distributed(*, rank: int, world_size: int, local_rank: int,
                     timeout_s: float = 600.0) -> DistributedContext:
    """Initialise torch.distributed: NCCL with one GPU per local rank, gloo without CUDA.

    ``timeout_s`` bounds every collective of the default group, so a peer that died surfaces as an
    error on the survivors instead of a hang. The rendezvous address comes from torchrun
    (``MASTER_ADDR``/``MASTER_PORT``, read by torch's ``env://`` store). Installs
    :mod:`mcore_refit.compat` first, so Megatron works on CPU-only machines.
    """
    compat.install()
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return DistributedContext(rank=rank, world_size=world_size, local_rank=local_rank,
                              device=device)


def init_model_parallel(parallel: ParallelConfig, *, seed: int) -> None:
    """Create Megatron's tensor/pipeline/data-parallel groups for ``parallel`` and seed RNGs.

    Call on every rank. Megatron's model-parallel state is process-global (its API, not ours);
    :func:`destroy_model_parallel` resets it, so one process may run several layouts in turn.
    """
    from megatron.core import parallel_state, tensor_parallel

    parallel.data_parallel_size(dist.get_world_size())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
    )
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        # Registers the model-parallel CUDA RNG states; without it dropout inside attention fails
        # with "cuda rng state model-parallel-rng is not added".
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    """Tear down Megatron's model-parallel groups (torch.distributed stays up)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def shutdown() -> None:
    """Tear down Megatron's groups and torch.distributed. Safe to call after a failure."""
    if not dist.is_initialized():
        return
    destroy_model_parallel()
    dist.destroy_process_group()
