"""What each GPU of a benchmark launch must hold (see :mod:`mcore_refit.memory`), checked on
every rank before any process group or model exists.

Per trainer rank: its share of the weights (the whole synthetic set on trainer rank 0), the
refit's slots, ``transport_alone``'s captured copy of what it sends (Megatron source), the raw
link's buffer. Per engine (an inference rank, or a colocated rank's engine process): the whole
model, its slots when a source broadcasts to it, the raw link's buffer; a vLLM engine
(``bench.engine: vllm``) also its refit staging, its reference model (``bench.verify``) and its KV
cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mcore_refit.bench.config import BRIDGE_MODES, RefitBenchJob, check_layout
from mcore_refit.bench.sources import preset_config
from mcore_refit.bench.synthetic import synthetic_specs
from mcore_refit.bench.vllm import KV_CACHE_BYTES
from mcore_refit.memory import (
    PROCESS_OVERHEAD_BYTES,
    GpuNeed,
    ModelTensors,
    ProcessNeed,
    check_fits,
    dtype_bytes,
    place,
    slot_bytes,
    vllm_engine_parts,
)
from mcore_refit.non_colocated import non_colocated_device_index
from mcore_refit.refit import DEFAULT_SLOT_BYTES

REMEDY = ("Use more GPUs, fewer layers (megatron.num_layers), or drop the mode that needs the "
          "extra copy")


@dataclass(frozen=True)
class BenchModel:
    """The bytes the benchmark moves: the whole model, and per trainer rank its share."""

    total_bytes: int
    largest_tensor_bytes: int
    share_of: Callable[[int], int]  # trainer rank -> bytes of weights it holds


def bench_model(job: RefitBenchJob, *, tensors: ModelTensors | None = None) -> BenchModel:
    """The benchmark's model in bytes (``tensors``: the Megatron source's, when known)."""
    bench, megatron = job.bench, job.megatron
    if bench.source != "megatron":
        specs = synthetic_specs(bench.source, dtype=bench.torch_dtype)
        total = sum(s.num_bytes for s in specs)
        return BenchModel(total_bytes=total,
                          largest_tensor_bytes=max(s.num_bytes for s in specs),
                          share_of=lambda rank: total if rank == 0 else 0)
    if tensors is None:
        tensors = (ModelTensors.from_hf_path(megatron.hf_path) if megatron.hf_path is not None
                   else ModelTensors.from_hf_config(
                       preset_config(megatron.preset, num_layers=megatron.num_layers)))
    size = dtype_bytes(megatron.dtype)
    parallel = megatron.parallel
    data_parallel = bench.num_trainer_ranks // parallel.model_parallel_size

    def share_of(rank: int) -> int:
        # Megatron's rank order puts the pipeline stage outermost.
        return tensors.stage_numel(parallel, rank // (parallel.tensor * data_parallel)) * size

    return BenchModel(total_bytes=tensors.numel * size,
                      largest_tensor_bytes=tensors.largest_numel * size, share_of=share_of)


def bench_needs(job: RefitBenchJob, *, world_size: int, num_gpus: int,
                capacity_of: Callable[[int], int],
                tensors: ModelTensors | None = None) -> list[GpuNeed]:
    """Every GPU of a launch of ``world_size`` ranks on a node of ``num_gpus`` GPUs."""
    layout = check_layout(job, world_size=world_size)
    bench, plan = job.bench, job.refit.plan
    model = bench_model(job, tensors=tensors)
    trainers = layout.num_trainer_ranks
    if layout.placement == "non_colocated":
        def gpu_of(rank: int) -> int:
            return non_colocated_device_index(rank=rank, local_rank=rank,
                                              local_world_size=world_size,
                                              num_trainer_ranks=trainers, num_gpus=num_gpus)
    else:
        def gpu_of(rank: int) -> int:
            return rank

    slot_size = plan.slot_bytes
    if slot_size is None:
        slot_size = (int(plan.slot_fraction * capacity_of(gpu_of(0)))
                     if plan.slot_fraction is not None else DEFAULT_SLOT_BYTES)
    slots = slot_bytes(num_slots=plan.num_slots, slot_size=slot_size,
                       largest_tensor_bytes=model.largest_tensor_bytes)
    modes = set(bench.modes)
    refits = bool(modes - {"raw_link", "naive", "export_alone", "bridge_export_alone"})
    captured = "transport_alone" in modes and bench.source == "megatron"
    raw_link = bench.raw_link_bytes if "raw_link" in modes else 0
    gathered = model.largest_tensor_bytes if modes & set(BRIDGE_MODES) else 0

    def trainer(rank: int, *, raw: int) -> ProcessNeed:
        share = model.share_of(rank)
        return ProcessNeed(who=f"trainer rank {rank}", parts=(
            ("weights", share), ("refit slots", slots if refits and share else 0),
            ("transport_alone's captured copy", share if captured else 0),
            ("Bridge's gathered tensor", gathered), ("raw link buffers", raw),
            ("process overhead", PROCESS_OVERHEAD_BYTES)))

    vllm = (vllm_engine_parts(model.total_bytes, verify=bench.verify,
                              kv_cache_bytes=KV_CACHE_BYTES)
            if bench.engine == "vllm" and refits else ())

    def engine(who: str, *, own_slots: bool, raw: int) -> ProcessNeed:
        return ProcessNeed(who=who, parts=(
            ("the engine's copy of the model", model.total_bytes if refits else 0), *vllm,
            ("refit slots", slots if refits and own_slots else 0), ("raw link buffer", raw),
            ("process overhead", PROCESS_OVERHEAD_BYTES)))

    processes: dict[int, ProcessNeed] = {}
    if layout.placement == "non_colocated":
        for rank in range(trainers):
            processes[rank] = trainer(rank, raw=raw_link if rank == 0 else 0)
        for rank in range(trainers, world_size):
            local = [t for t in range(trainers) if gpu_of(t) == gpu_of(rank)]
            processes[rank] = engine(f"inference rank {rank - trainers}",
                                     own_slots=len(local) < trainers,
                                     raw=raw_link if gpu_of(0) != gpu_of(rank) else 0)
        return place(processes, gpu_of, capacity_of)
    # Colocated: an engine process beside every trainer rank; it maps the trainer's slots.
    needs = []
    for rank in range(trainers):
        own = [trainer(rank, raw=2 * raw_link)]
        if layout.placement == "colocated":
            own.append(engine(f"trainer rank {rank}'s engine", own_slots=False, raw=0))
        needs.append(GpuNeed(gpu=gpu_of(rank), processes=tuple(own),
                             capacity=capacity_of(gpu_of(rank))))
    return needs


def check_bench_memory(job: RefitBenchJob, *, world_size: int, num_gpus: int,
                       capacity_of: Callable[[int], int],
                       tensors: ModelTensors | None = None) -> None:
    """Raise :class:`~mcore_refit.memory.InsufficientGpuMemory` when a GPU cannot hold its
    ranks (one message naming each such GPU, its ranks, their need and its memory)."""
    check_fits(bench_needs(job, world_size=world_size, num_gpus=num_gpus,
                           capacity_of=capacity_of, tensors=tensors), remedy=REMEDY)
