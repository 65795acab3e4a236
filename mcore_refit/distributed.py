"""Process groups for one job: torch.distributed, Megatron's model-parallel state, RNG seeds.

Library code never reads the environment; recipes read torchrun's variables and pass them in.
"""

from __future__ import annotations

import datetime
import logging
import socket
import sys
from dataclasses import dataclass, field

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
    device = _cuda_device(lambda num_gpus: colocated_device_index(
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
    control_group = _control_group(device, timeout)
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


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a split job's ranks sit, the same on every rank.

    Job ranks are trainer ranks ``0 .. num_trainers-1`` then inference ranks; ``shared`` holds
    the ``(trainer rank, inference rank)`` pairs that share a device.
    """

    num_trainers: int
    num_receivers: int
    shared: frozenset[tuple[int, int]] = frozenset()

    def control_rank(self, receiver: int) -> int:
        return self.num_trainers + receiver

    def name_of(self, control_rank: int) -> str:
        if control_rank < self.num_trainers:
            return f"trainer rank {control_rank}"
        return f"inference rank {control_rank - self.num_trainers}"

    def ipc(self, source: int, receiver: int) -> bool:
        return (source, receiver) in self.shared

    def ipc_receivers(self, source: int) -> list[int]:
        return [r for r in range(self.num_receivers) if self.ipc(source, r)]

    def remote_receivers(self, source: int) -> list[int]:
        """The inference ranks ``source`` broadcasts to (group ranks 1.. of its data group)."""
        return [r for r in range(self.num_receivers) if not self.ipc(source, r)]

    def relay_links(self) -> list[tuple[int, int]]:
        """Every ``(from, to)`` pair of job ranks a relay refit moves buffers between (each
        source to its remote inference ranks, and among those), in one order for every rank
        (see :mod:`mcore_refit.refit.fanout`)."""
        links: list[tuple[int, int]] = []
        for source in range(self.num_trainers):
            receivers = [self.control_rank(r) for r in self.remote_receivers(source)]
            links += [(source, receiver) for receiver in receivers]
            links += [(entry, other) for entry in receivers for other in receivers
                      if other != entry]
        return list(dict.fromkeys(links))


@dataclass(frozen=True, kw_only=True)
class SplitJob:
    """One torchrun launch split into trainer ranks and inference ranks (non-colocated mode).

    Each role has its own default process group (``context`` is role-local: rank 0 is the first
    rank of the role), so Megatron's model-parallel state on the trainer ranks never sees the
    inference ranks. Groups across roles, all standalone (unknown to ``torch.distributed``'s
    world: use their own methods, ``rank()``, ``broadcast()``, ...):

    - ``refit_control`` (gloo): every rank, trainer ranks first — the refits' control plane;
    - ``data_groups`` (NCCL on GPU): per trainer rank, the group it broadcasts refit buffers over
      (itself as group rank 0, then every inference rank on another device); holds the groups
      this rank is a member of, by trainer rank;
    - ``control_group`` (gloo): trainer rank 0 and every inference rank (its rank 0 is trainer
      rank 0) — commands to the inference ranks; None on the other trainer ranks;
    - ``links`` (NCCL on GPU; only with ``fanout="relay"``): a two-rank group per direction of
      each pair of ranks a relay refit moves buffers between, keyed by ``(from, to)`` job rank
      (the sender is group rank 0; see :mod:`mcore_refit.refit.fanout`); this rank's own.

    ``placement`` says which trainer and inference ranks share a device (their buffers move over
    CUDA IPC: NCCL refuses two ranks of one device in a communicator).
    """

    role: str  # "trainer" | "inference"
    context: DistributedContext
    global_rank: int
    num_trainer_ranks: int
    num_inference_ranks: int
    placement: Placement
    refit_control: dist.ProcessGroup
    data_groups: dict[int, dist.ProcessGroup]
    control_group: dist.ProcessGroup | None
    links: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)

    @property
    def is_trainer(self) -> bool:
        return self.role == "trainer"


def init_split_job(*, rank: int, world_size: int, local_rank: int, num_inference_ranks: int,
                   store_host: str, store_port: int, local_world_size: int | None = None,
                   timeout_s: float = 600.0, liveness_s: float | None = None,
                   fanout: str = "broadcast") -> SplitJob:
    """Initialise a non-colocated job: the last ``num_inference_ranks`` ranks serve inference.

    The job may span nodes: ``local_rank`` and ``local_world_size`` (torchrun's ``LOCAL_RANK``
    and ``LOCAL_WORLD_SIZE``; the latter defaults to ``world_size``, one node) pick this rank's
    GPU on its own node (:func:`split_job_device_index`). Every rank connects to the launcher's
    key-value store (torchrun's ``MASTER_ADDR`` and ``MASTER_PORT``) and builds its role's
    default group and the cross-role groups it is a member of, from separate key prefixes.
    Call on every rank of the launch. With ``liveness_s``, ``context.peers`` watches every other
    rank of the job, of both roles. ``fanout="relay"`` also builds the relay's links
    (``refit.transport.fanout``).
    """
    compat.install()
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    if not 0 < num_inference_ranks < world_size:
        raise ValueError(f"inference.num_ranks={num_inference_ranks} must leave at least one "
                         f"trainer rank and one inference rank among {world_size} ranks")
    num_trainer_ranks = world_size - num_inference_ranks
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timeout)
    is_trainer = rank < num_trainer_ranks
    role = "trainer" if is_trainer else "inference"
    role_rank = rank if is_trainer else rank - num_trainer_ranks
    role_size = num_trainer_ranks if is_trainer else num_inference_ranks
    device = _cuda_device(lambda num_gpus: split_job_device_index(
        rank=rank, local_rank=local_rank,
        local_world_size=local_world_size if local_world_size is not None else world_size,
        num_trainer_ranks=num_trainer_ranks, num_gpus=num_gpus))
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore(f"{role}/", store), rank=role_rank, world_size=role_size,
        timeout=timeout, device_id=device if device.type == "cuda" else None,
    )
    placement = _placement(store, rank=rank, device=device, num_trainer_ranks=num_trainer_ranks,
                           num_inference_ranks=num_inference_ranks)
    refit_control = _standalone_group(dist.PrefixStore("refit-control/", store), rank=rank,
                                      size=world_size, device=torch.device("cpu"),
                                      timeout=timeout)
    data_groups = {}
    for source in range(num_trainer_ranks):
        members = [source] + [num_trainer_ranks + r for r in placement.remote_receivers(source)]
        if rank in members and len(members) > 1:
            data_groups[source] = _standalone_group(
                dist.PrefixStore(f"refit-data/{source}/", store), rank=members.index(rank),
                size=len(members), device=device, timeout=timeout)
    links = {}
    if fanout == "relay":
        for sender, receiver in placement.relay_links():
            group = _standalone_group(dist.PrefixStore(f"refit-link/{sender}-{receiver}/", store),
                                      rank=0 if rank == sender else 1, size=2, device=device,
                                      timeout=timeout) if rank in (sender, receiver) else None
            if group is not None:
                links[(sender, receiver)] = group
    control_group = None
    if rank == 0 or not is_trainer:
        control_group = _standalone_group(dist.PrefixStore("control/", store),
                                          rank=0 if is_trainer else 1 + role_rank,
                                          size=1 + num_inference_ranks,
                                          device=torch.device("cpu"), timeout=timeout)
    peers = None
    if liveness_s is not None:
        peers = watch_peers(refit_control, name_of=placement.name_of, interval_s=liveness_s,
                            timeout_s=timeout_s)
    context = DistributedContext(rank=role_rank, world_size=role_size, local_rank=local_rank,
                                 device=device, control_group=_control_group(device, timeout),
                                 peers=peers)
    return SplitJob(role=role, context=context, global_rank=rank,
                    num_trainer_ranks=num_trainer_ranks, num_inference_ranks=num_inference_ranks,
                    placement=placement, refit_control=refit_control, data_groups=data_groups,
                    control_group=control_group, links=links)


def _placement(store, *, rank: int, device: torch.device, num_trainer_ranks: int,
               num_inference_ranks: int) -> Placement:
    """Which trainer and inference ranks share a device, from every rank's device identity."""
    identity = (f"{socket.gethostname()}:{torch.cuda.get_device_properties(device).uuid}"
                if device.type == "cuda" else f"{socket.gethostname()}:cpu:{rank}")
    store.set(f"device/{rank}", identity)
    world_size = num_trainer_ranks + num_inference_ranks
    identities = [store.get(f"device/{r}").decode() for r in range(world_size)]
    shared = frozenset((t, r) for t in range(num_trainer_ranks) for r in range(num_inference_ranks)
                       if identities[t] == identities[num_trainer_ranks + r])
    return Placement(num_trainers=num_trainer_ranks, num_receivers=num_inference_ranks,
                     shared=shared)


def colocated_device_index(*, local_rank: int, local_world_size: int, num_gpus: int) -> int:
    """The GPU of a colocated rank on its node: one GPU per local rank (its engine shares it)."""
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} is outside this node's {local_world_size} ranks")
    if local_world_size > num_gpus:
        raise ValueError(f"{local_world_size} ranks on this node but it has {num_gpus} GPUs: a "
                         "colocated job runs one trainer rank (and its engine) per GPU")
    return local_rank


def split_job_device_index(*, rank: int, local_rank: int, local_world_size: int,
                           num_trainer_ranks: int, num_gpus: int) -> int:
    """The GPU of job rank ``rank`` of a split job on its node (pure index maths).

    torchrun numbers each node's ranks contiguously: this node holds job ranks ``rank −
    local_rank`` onwards, ``local_world_size`` of them, trainer ranks (below
    ``num_trainer_ranks``) before inference ranks. With a GPU per local rank, each rank takes
    GPU ``local_rank``, on every node. With fewer GPUs than local ranks, the node's trainer ranks
    take GPUs ``0, 1, ...`` and its inference ranks share the last GPUs with trainer ranks, never
    the GPU of the node's first trainer rank (trainer rank 0 on the first node), so the refit
    still crosses devices.
    """
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} is outside this node's {local_world_size} ranks")
    if local_world_size <= num_gpus:
        return local_rank
    first = rank - local_rank
    num_local_trainers = max(0, min(num_trainer_ranks - first, local_world_size))
    num_local_inference = local_world_size - num_local_trainers
    if num_local_trainers > num_gpus:
        raise ValueError(f"{num_local_trainers} trainer ranks on this node but it has {num_gpus} "
                         "GPUs: launch at most one trainer rank per GPU")
    if num_local_trainers and num_local_inference > num_gpus - 1:
        raise ValueError(f"{num_local_inference} inference ranks on this node need GPUs other "
                         f"than its first trainer rank's, but this node has {num_gpus}")
    if num_local_inference > num_gpus:
        raise ValueError(f"{num_local_inference} inference ranks on this node but it has "
                         f"{num_gpus} GPUs: launch at most one inference rank per GPU")
    if local_rank < num_local_trainers:
        return local_rank
    return num_gpus - num_local_inference + (local_rank - num_local_trainers)


def _control_group(device: torch.device, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo group over the default group's ranks (collective: every rank of it calls this)."""
    if device.type != "cuda":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timeout)


def _cuda_device(index_for) -> torch.device:
    """The CPU without CUDA, else GPU ``index_for(number of GPUs on this node)``, made current."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", index_for(torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device


def _standalone_group(store, *, rank: int, size: int, device: torch.device,
                      timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A process group outside the default world: a bare NCCL or gloo backend object.

    It offers ``rank()``, ``size()``, ``broadcast()``, ``allreduce()``, ``allgather()`` but is
    unknown to the ``torch.distributed`` functions that take ``group=``.
    """
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
