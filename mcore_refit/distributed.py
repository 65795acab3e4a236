"""Process groups for one job: torch.distributed, Megatron's model-parallel state, RNG seeds.

Library code never reads the environment; recipes read torchrun's variables and pass them in.
"""

from __future__ import annotations

import datetime
import logging
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_refit import compat
from mcore_refit.config import ParallelConfig
from mcore_refit.control import ControlGroup
from mcore_refit.processes import PeerWatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DistributedContext:
    """Where this process sits in the job.

    ``control_group`` is a gloo group over the same ranks as the default group (the default
    group itself when that is gloo): waits for peers go over it, on the host, so a waiting rank
    holds no GPU kernel (which would time-slice with another process on its GPU). ``peers``
    watches every other process of the job (given ``liveness_s``; see :func:`watch_peers`).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    control_group: dist.ProcessGroup
    peers: PeerWatch | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def init_distributed(*, rank: int, world_size: int, local_rank: int,
                     local_world_size: int | None = None, timeout_s: float = 600.0,
                     liveness_s: float | None = None) -> DistributedContext:
    """Initialise torch.distributed: NCCL with one GPU per local rank, gloo without CUDA.

    ``local_rank`` and ``local_world_size`` (torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``;
    the latter defaults to ``world_size``, one node) place the rank on this node's GPUs, on every
    node of a multi-node launch (:func:`colocated_device_index`).

    ``timeout_s`` bounds every collective of the default group, so a peer that died surfaces as an
    error on the survivors instead of a hang. The rendezvous address comes from torchrun
    (``MASTER_ADDR``/``MASTER_PORT``, read by torch's ``env://`` store). Installs
    :mod:`mcore_refit.compat` first, so Megatron works on CPU-only machines. With
    ``liveness_s``, ``context.peers`` watches the other ranks (named ``trainer rank <r>``).
    """
    compat.install()
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    device = select_device(lambda num_gpus: colocated_device_index(
        local_rank=local_rank,
        local_world_size=local_world_size if local_world_size is not None else world_size,
        num_gpus=num_gpus))
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    control_group = host_control_group(device, timeout)
    peers = None
    if liveness_s is not None:
        peers = watch_peers(control_group, name_of=lambda r: f"trainer rank {r}",
                            interval_s=liveness_s, timeout_s=timeout_s)
    return DistributedContext(rank=rank, world_size=world_size, local_rank=local_rank,
                              device=device, control_group=control_group, peers=peers)


def watch_peers(group: dist.ProcessGroup, *, name_of, interval_s: float,
                timeout_s: float) -> PeerWatch:
    """A :class:`~mcore_refit.processes.PeerWatch` over the other ranks of the gloo ``group``
    (see :meth:`ControlGroup.watch_peers`). Collective: call on every rank of it."""
    control = ControlGroup(group, timeout_s=timeout_s, name="the job's ranks")
    return control.watch_peers(name_of=name_of, interval_s=interval_s)


@dataclass(frozen=True, kw_only=True)
class ModelParallel:
    """Megatron's model-parallel layout on this rank, as :func:`init_model_parallel` created it.

    The one handle the layout travels by: :func:`~mcore_refit.model.build_model` and everything
    built on it read the layout and this rank's place in it from here, never from Megatron's
    process-global state again.
    """

    parallel: ParallelConfig
    tp_rank: int
    tp_size: int
    tp_group: dist.ProcessGroup
    pp_rank: int
    pp_size: int
    pp_group: dist.ProcessGroup
    pp_last_rank: int  # global rank of this pipeline's last stage
    dp_rank: int
    dp_size: int
    dp_group: dist.ProcessGroup
    # Expert parallelism (parallel.expert): this rank's place among the ranks that split each
    # MoE layer's experts (size 1 and rank 0 without it).
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: dist.ProcessGroup | None = None

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def init_model_parallel(parallel: ParallelConfig, *, seed: int) -> ModelParallel:
    """Create Megatron's tensor/pipeline/data-parallel groups for ``parallel``, seed the RNGs and
    return the layout handle to build models with.

    Call on every rank. Megatron's model-parallel state is process-global (its API, not ours);
    :func:`destroy_model_parallel` resets it, so one process may run several layouts in turn.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    parallel.data_parallel_size(dist.get_world_size())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        expert_model_parallel_size=parallel.expert,
    )
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        # Registers the model-parallel CUDA RNG states; without it dropout inside attention fails
        # with "cuda rng state model-parallel-rng is not added".
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ModelParallel(
        parallel=parallel,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        pp_last_rank=ps.get_pipeline_model_parallel_last_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_group=ps.get_data_parallel_group(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        ep_group=ps.get_expert_model_parallel_group(),
    )


def destroy_model_parallel() -> None:
    """Tear down Megatron's model-parallel groups (torch.distributed stays up); nothing to do in
    a process that never imported them (an inference rank: importing Megatron takes seconds)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()


def shutdown(*, failed: bool = False) -> None:
    """Tear down Megatron's groups and torch.distributed.

    After a failure (``failed``: a peer may be gone, a group broken) errors of the teardown are
    logged, not raised, so they never replace the failure being raised, and NCCL's communicators
    are left to the process's exit, which a failed rank is on its way to: tearing them down
    waits on their peers and kernels — on two H200s a destroy took ~8 s after a dead engine, an
    abort 17 s, and a destroy never returned once a peer had died mid-collective
    (``benchmarks/faults.sh``) — while the exit itself releases them: a SIGKILLed CUDA process
    (1 or 40 GiB allocated, a peer's tensor mapped over CUDA IPC, idle or busy) was a zombie
    within 2.4 ms and reaped within 0.11 s. torch.distributed then stays initialised here.
    """
    if not dist.is_initialized():
        return
    try:
        destroy_model_parallel()
        if not (failed and dist.get_backend() == "nccl"):
            dist.destroy_process_group()
    except Exception:
        if not failed:
            raise
        logger.warning("tearing down the process groups after a failure", exc_info=True)


def colocated_device_index(*, local_rank: int, local_world_size: int, num_gpus: int) -> int:
    """The GPU of a colocated rank on its node: one GPU per local rank (its engine shares it)."""
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} is outside this node's {local_world_size} ranks")
    if local_world_size > num_gpus:
        raise ValueError(f"{local_world_size} ranks on this node but it has {num_gpus} GPUs: a "
                         "colocated job runs one trainer rank (and its engine) per GPU")
    return local_rank


def host_control_group(device: torch.device, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo group over the default group's ranks (collective: every rank of it calls this)."""
    if device.type != "cuda":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timeout)


def select_device(index_for) -> torch.device:
    """The CPU without CUDA, else GPU ``index_for(number of GPUs on this node)``, made current."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", index_for(torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device

