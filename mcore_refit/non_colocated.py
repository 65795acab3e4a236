"""A non-colocated launch: one torchrun job split into trainer ranks and inference ranks.

Each role gets its own default process group, and the groups across roles the refit and the
commands use (:class:`NonColocatedJob`): the refit's control plane over every rank, a data group
per source trainer rank (or the two-rank links of the relay and direct fan-outs), the command
group, and the :class:`~mcore_refit.refit.Placement` of ranks on devices. Library code never
reads the environment; recipes pass torchrun's variables in.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mcore_refit import compat
from mcore_refit.distributed import (
    DistributedContext,
    host_control_group,
    select_device,
    watch_peers,
)
from mcore_refit.refit import Placement


@dataclass(frozen=True, kw_only=True)
class NonColocatedJob:
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
    - ``links`` (NCCL on GPU; only with ``fanout="relay"`` or ``"direct"``): a two-rank group
      per direction of each pair of ranks such a refit moves buffers between, keyed by
      ``(from, to)`` job rank (the sender is group rank 0; see
      :mod:`mcore_refit.refit.transports.non_colocated.fanout`); this rank's own.

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


def init_non_colocated_job(*, rank: int, world_size: int, local_rank: int, num_inference_ranks: int,
                   store_host: str, store_port: int, local_world_size: int | None = None,
                   timeout_s: float = 600.0, liveness_s: float | None = None,
                   fanout: str = "broadcast") -> NonColocatedJob:
    """Initialise a non-colocated job: the last ``num_inference_ranks`` ranks serve inference.

    The job may span nodes: ``local_rank`` and ``local_world_size`` (torchrun's ``LOCAL_RANK``
    and ``LOCAL_WORLD_SIZE``; the latter defaults to ``world_size``, one node) pick this rank's
    GPU on its own node (:func:`non_colocated_device_index`). Every rank connects to the launcher's
    key-value store (torchrun's ``MASTER_ADDR`` and ``MASTER_PORT``) and builds its role's
    default group and the cross-role groups it is a member of, from separate key prefixes.
    Call on every rank of the launch. With ``liveness_s``, ``context.peers`` watches every other
    rank of the job, of both roles. ``fanout="relay"`` also builds the relay's links,
    ``fanout="direct"`` those from each source to its remote inference ranks (a subset of the
    relay's: a job built for the relay runs the direct fan-out too; ``refit.transport.fanout``).
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
    device = select_device(lambda num_gpus: non_colocated_device_index(
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
    pairs = {"relay": placement.relay_links, "direct": placement.direct_links}.get(fanout)
    if pairs is not None:
        for sender, receiver in pairs():
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
                                 device=device, control_group=host_control_group(device, timeout),
                                 peers=peers)
    return NonColocatedJob(role=role, context=context, global_rank=rank,
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


def non_colocated_device_index(*, rank: int, local_rank: int, local_world_size: int,
                           num_trainer_ranks: int, num_gpus: int) -> int:
    """The GPU of job rank ``rank`` of a non-colocated job on its node (pure index maths).

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
