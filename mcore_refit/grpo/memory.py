"""What each GPU of a GRPO launch must hold (see :mod:`mcore_refit.memory`), checked before any
process group or model exists.

Per trainer rank: its share of the weights (``model.dtype``), fp32 gradients, Adam's state and
the refit's slots. Per engine (an inference rank, or a colocated rank's engine process): the
whole model at ``inference.dtype`` and, on an inference rank that a source broadcasts to, its
slots; a vLLM engine also its refit staging, its reference model (``run.verify_refit``) and its KV
cache (``inference.vllm.kv_cache_bytes``; when null, vLLM fills ``gpu_memory_utilization`` of the
GPU). A colocated GPU holds both at the refit (offloading is not credited: the refit needs the
trainer's weights and the engine's at once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mcore_refit.distributed import colocated_device_index
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.memory import (
    PROCESS_OVERHEAD_BYTES,
    GpuNeed,
    ModelTensors,
    ProcessNeed,
    check_fits,
    dtype_bytes,
    place,
    slot_bytes,
    trainer_state_bytes,
    vllm_engine_parts,
)
from mcore_refit.non_colocated import non_colocated_device_index
from mcore_refit.refit import DEFAULT_SLOT_BYTES

logger = logging.getLogger(__name__)

REMEDY = ("Use more GPUs (more pipeline, tensor or expert parallelism), "
          "policy.optimizer.use_distributed_optimizer, or a smaller model")


def grpo_needs(config: GRPOJobConfig, *, world_size: int, local_world_size: int, num_gpus: int,
               capacity_of: Callable[[int], int],
               tensors: ModelTensors | None = None) -> list[GpuNeed]:
    """Every GPU of every node of a launch of ``world_size`` ranks, ``local_world_size`` per
    node of ``num_gpus`` GPUs (GPU numbers are a node's own; nodes are checked one by one)."""
    if tensors is None:
        tensors = ModelTensors.from_hf_path(config.model.hf_path)
    parallel, plan = config.parallel, config.refit.plan
    colocated = config.refit.mode == "colocated"
    trainers = world_size if colocated else world_size - config.inference.num_ranks
    data_parallel = trainers // parallel.model_parallel_size
    weight_bytes = dtype_bytes(config.model.dtype)
    engine_bytes = tensors.numel * dtype_bytes(config.inference.dtype)
    slot_size = plan.slot_bytes
    if slot_size is None:
        slot_size = (int(plan.slot_fraction * capacity_of(0)) if plan.slot_fraction is not None
                     else DEFAULT_SLOT_BYTES)
    sharing_weights = colocated and config.refit.transport.ipc_sharing == "weights"
    slots = 0 if sharing_weights else slot_bytes(
        num_slots=plan.num_slots, slot_size=slot_size,
        largest_tensor_bytes=tensors.largest_numel * weight_bytes)

    def gpu_of(rank: int) -> int:
        local = rank % local_world_size
        if colocated:
            return colocated_device_index(local_rank=local, local_world_size=local_world_size,
                                          num_gpus=num_gpus)
        return non_colocated_device_index(rank=rank, local_rank=local,
                                      local_world_size=local_world_size,
                                      num_trainer_ranks=trainers, num_gpus=num_gpus)

    def trainer(rank: int) -> ProcessNeed:
        numel = tensors.stage_numel(parallel, rank // (parallel.tensor * data_parallel))
        state = trainer_state_bytes(
            numel, dtype=config.model.dtype, data_parallel=data_parallel,
            distributed_optimizer=config.policy.optimizer.use_distributed_optimizer)
        return ProcessNeed(who=f"trainer rank {rank}", parts=(
            ("weights", numel * weight_bytes), *state, ("refit slots", slots),
            ("process overhead", PROCESS_OVERHEAD_BYTES)))

    def vllm_parts(gpu: int) -> tuple[tuple[str, int], ...]:
        if config.inference.engine != "vllm":
            return ()
        options = config.inference.vllm
        kv_cache = options.kv_cache_bytes
        if kv_cache is None:
            kv_cache = max(0, int(options.gpu_memory_utilization * capacity_of(gpu))
                           - engine_bytes)
        return vllm_engine_parts(engine_bytes, verify=config.run.verify_refit,
                                 kv_cache_bytes=kv_cache)

    def engine(who: str, *, own_slots: bool, gpu: int) -> ProcessNeed:
        return ProcessNeed(who=who, parts=(
            ("the engine's copy of the model", engine_bytes), *vllm_parts(gpu),
            ("refit slots", slots if own_slots else 0),
            ("process overhead", PROCESS_OVERHEAD_BYTES)))

    needs = []
    for node_start in range(0, world_size, local_world_size):
        ranks = range(node_start, min(node_start + local_world_size, world_size))
        processes: dict[int, ProcessNeed] = {}
        engines: list[tuple[int, ProcessNeed]] = []
        for rank in ranks:
            if rank < trainers:
                processes[rank] = trainer(rank)
                if colocated:
                    engines.append((rank, engine(f"trainer rank {rank}'s engine",
                                                 own_slots=False, gpu=gpu_of(rank))))
            else:
                local = [t for t in range(trainers) if t in ranks and gpu_of(t) == gpu_of(rank)]
                processes[rank] = engine(f"inference rank {rank - trainers}",
                                         own_slots=len(local) < trainers, gpu=gpu_of(rank))
        for gpu in place(processes, gpu_of, capacity_of):
            extra = tuple(need for rank, need in engines if gpu_of(rank) == gpu.gpu)
            needs.append(GpuNeed(gpu=gpu.gpu, processes=gpu.processes + extra,
                                 capacity=gpu.capacity))
    return needs


def check_grpo_memory(config: GRPOJobConfig, *, world_size: int, local_world_size: int,
                      num_gpus: int, capacity_of: Callable[[int], int],
                      tensors: ModelTensors | None = None) -> None:
    """Raise :class:`~mcore_refit.memory.InsufficientGpuMemory` when a GPU cannot hold its
    ranks (one message naming each such GPU, its ranks, their need and its memory). A model
    whose shapes transformers cannot lay out on the meta device is not checked (a warning)."""
    if tensors is None:
        try:
            tensors = ModelTensors.from_hf_path(config.model.hf_path)
        except Exception as error:  # the check is advice; the start-up reports real problems
            logger.warning("GPU memory not checked before the start: the shapes of %s: %s",
                           config.model.hf_path, error)
            return
    check_fits(grpo_needs(config, world_size=world_size, local_world_size=local_world_size,
                          num_gpus=num_gpus, capacity_of=capacity_of, tensors=tensors),
               remedy=REMEDY)
