"""What each GPU of a job must hold, estimated from the config before anything is built.

A job whose processes cannot fit on their GPUs fails minutes into its start-up (a model built, an
engine loaded, the first refit's capture) with a CUDA out-of-memory error on one rank, while the
others wait or time out. :func:`check_fits` refuses it at once instead, with one message naming
each GPU that is short, the ranks on it, what each needs and what the GPU holds.

The estimate counts what a process certainly holds — its share of the trainer's weights,
gradients and optimizer state, the refit's slots, an engine's copy of the model, a benchmark
mode's extra copy — plus :data:`PROCESS_OVERHEAD_BYTES` per process for what is not tensors.
Activations and generation's KV cache are not counted. Nothing here touches a GPU: the GPUs'
capacities come in as numbers (:func:`gpu_capacities` reads them from the devices).

The model's tensors come from its Hugging Face config, built on the ``meta`` device (shapes
only, no memory): the engine holds them all; a trainer rank holds its pipeline stages' layers
(the first stage also the embedding, the last the output layer and final norm), every matrix
split over tensor-parallel ranks and every expert tensor over expert-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from mcore_refit.config import ParallelConfig

GIB = 1 << 30

# Per process, beyond its tensors: the CUDA context, NCCL's communicators and buffers, and the
# caching allocator's partly used segments. Measured on an H200 (2026-11-26, the 48-layer
# Qwen3-30B-A3B preset at EP2, the engine beside trainer rank 1): the engine held 66.8 GiB for
# 58.9 GiB of tensors and slots; the trainer rank held 73 GiB when its capture ran out of
# memory, for at most 62.7 GiB of tensors, slots and the raw link's buffer.
PROCESS_OVERHEAD_BYTES = 10 * GIB

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class InsufficientGpuMemory(RuntimeError):
    """A job's estimated need exceeds a GPU's memory (raised before anything starts)."""


@dataclass(frozen=True)
class ModelTensor:
    """One tensor of the Hugging Face model, with what splits it on the trainer."""

    name: str
    numel: int
    layer: int | None  # decoder layer index; None for embedding, output layer, final norm
    expert: bool  # split over expert-parallel ranks
    matrix: bool  # split over tensor-parallel ranks (2-D and larger, the router excepted)


@dataclass(frozen=True)
class ModelTensors:
    """A model's tensors: what the engine holds and what the trainer ranks split."""

    tensors: tuple[ModelTensor, ...]
    num_layers: int

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def largest_numel(self) -> int:
        return max((t.numel for t in self.tensors), default=0)

    def stage_numel(self, parallel: ParallelConfig, pp_rank: int) -> int:
        """Elements one trainer rank of pipeline stage ``pp_rank`` holds (each tensor-parallel
        and expert-parallel rank of a stage holds the same share)."""
        chunks = parallel.pipeline * parallel.num_model_chunks
        last = parallel.pipeline - 1
        total = 0.0
        for tensor in self.tensors:
            if tensor.layer is None:
                stage = 0 if "embed" in tensor.name else last
                if stage != pp_rank:
                    continue
            elif (tensor.layer * chunks // self.num_layers) % parallel.pipeline != pp_rank:
                continue
            share = tensor.numel / (parallel.tensor if tensor.matrix else 1)
            total += share / (parallel.expert if tensor.expert else 1)
        return int(total)

    @classmethod
    def from_hf_config(cls, config) -> ModelTensors:
        """The tensors of the model ``config`` (a transformers config) describes."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        tensors = []
        for name, param in model.named_parameters():
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else None
            router = parts[-2] in ("gate", "router") and "experts" not in parts
            tensors.append(ModelTensor(name=name, numel=param.numel(), layer=layer,
                                       expert="experts" in parts,
                                       matrix=param.dim() >= 2 and not router))
        return cls(tensors=tuple(tensors), num_layers=config.num_hidden_layers)

    @classmethod
    def from_hf_path(cls, hf_path: str) -> ModelTensors:
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(hf_path))


@dataclass(frozen=True)
class ProcessNeed:
    """What one process holds on its GPU, part by part (bytes)."""

    who: str  # "trainer rank 1", "inference rank 0", "trainer rank 0's engine"
    parts: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(size for _, size in self.parts)

    def describe(self) -> str:
        parts = " + ".join(f"{what} {_gib(size)}" for what, size in self.parts if size)
        return f"{self.who}: {_gib(self.total)} GiB = {parts}"


@dataclass(frozen=True)
class GpuNeed:
    """The processes on one GPU and what the GPU holds."""

    gpu: int
    processes: tuple[ProcessNeed, ...]
    capacity: int

    @property
    def need(self) -> int:
        return sum(p.total for p in self.processes)

    def shortfall(self) -> str | None:
        """Why this GPU cannot hold its processes, or None when it can."""
        if self.need <= self.capacity:
            return None
        who = " and ".join(p.who for p in self.processes)
        parts = "; ".join(p.describe() for p in self.processes)
        return (f"GPU {self.gpu} cannot hold {who}: they need {_gib(self.need)} GiB, the GPU "
                f"has {_gib(self.capacity)} GiB ({parts})")


def check_fits(gpus: Iterable[GpuNeed], *, remedy: str = "") -> None:
    """Raise :class:`InsufficientGpuMemory` naming every GPU whose processes do not fit."""
    short = [reason for gpu in gpus if (reason := gpu.shortfall()) is not None]
    if short:
        raise InsufficientGpuMemory("; ".join(short) + (f". {remedy}" if remedy else ""))


def place(processes: dict[int, ProcessNeed], gpu_of: Callable[[int], int],
          capacity_of: Callable[[int], int]) -> list[GpuNeed]:
    """Group the processes (by rank) onto their GPUs (``gpu_of(rank)``)."""
    by_gpu: dict[int, list[ProcessNeed]] = {}
    for rank, need in processes.items():
        by_gpu.setdefault(gpu_of(rank), []).append(need)
    return [GpuNeed(gpu=gpu, processes=tuple(needs), capacity=capacity_of(gpu))
            for gpu, needs in sorted(by_gpu.items())]


def gpu_capacities() -> Callable[[int], int]:
    """Each local GPU's total memory. Total, not free: every rank checks at start-up while its
    peers may already be allocating, and the answer must not depend on who came first."""
    return lambda index: torch.cuda.get_device_properties(index).total_memory


def dtype_bytes(dtype: str) -> int:
    return _DTYPE_BYTES[dtype]


def slot_bytes(*, num_slots: int, slot_size: int, largest_tensor_bytes: int) -> int:
    """A refit side's slots: ``num_slots`` of ``slot_size`` and, when some tensor exceeds a slot,
    an extra slot as large as the largest one (``plan.slot_bytes`` × slots + oversized)."""
    extra = largest_tensor_bytes if largest_tensor_bytes > slot_size else 0
    return num_slots * slot_size + extra


def trainer_state_bytes(numel: int, *, dtype: str, distributed_optimizer: bool,
                        data_parallel: int) -> tuple[tuple[str, int], ...]:
    """A training rank's gradients and Adam state for ``numel`` parameters of ``dtype``.

    Gradients are reduced in fp32 (the policy's DDP setting). Adam keeps two fp32 moments, and
    for a bf16 model an fp32 master copy too; the distributed optimizer shards those over the
    data-parallel ranks.
    """
    per_param = 8 + (4 if dtype != "float32" else 0)
    optimizer = numel * per_param // (data_parallel if distributed_optimizer else 1)
    return (("gradients (fp32)", numel * 4), ("Adam state", optimizer))


def vllm_engine_parts(model_bytes: int, *, verify: bool,
                      kv_cache_bytes: int) -> tuple[tuple[str, int], ...]:
    """What a vLLM engine holds beyond its copy of the model during a refit: the staging every
    received tensor is copied into (the payload once, see ``inference/vllm/staging.py``; an upper
    bound: with a slot per buffer only tensor-parallel pieces are copied), the
    reference model a verified refit loads the same tensors into (once more), and its KV cache."""
    return (("vLLM's refit staging", model_bytes),
            ("vLLM's reference model (verify)", model_bytes if verify else 0),
            ("vLLM's KV cache", kv_cache_bytes))


def _gib(size: int) -> str:
    return f"{size / GIB:.1f}"
