"""The refit benchmark's configuration and launch layout (the ``bench`` and ``megatron``
sections of ``recipes/refit_bench.py``'s YAML)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mcore_refit.config import ConfigError, Dtype, LayerSpec, ParallelConfig
from mcore_refit.refit import Fanout, RefitConfig

Mode = Literal["raw_link", "naive", "single_buffer", "engine", "export_alone", "transport_alone",
               "bridge_export", "bridge_export_alone", "shared_weights", "vllm_load_floor"]
Engine = Literal["tensors", "vllm"]
SourceName = Literal["dense_8b", "moe_30b_a3b", "tiny", "megatron"]
Preset = Literal["llama3_8b", "qwen3_30b_a3b", "tiny_llama", "tiny_qwen3_moe"]

# Modes that need the Megatron source (they measure Megatron-Bridge's own export).
BRIDGE_MODES = ("bridge_export", "bridge_export_alone")
# Modes only the colocated placement has (the engine reads the trainer's tensors in place).
COLOCATED_MODES = ("shared_weights",)
# Modes that need bench.engine=vllm.
VLLM_MODES = ("vllm_load_floor",)
# Modes that refit (into the engine), as opposed to the limits and the export alone.
REFIT_MODES = ("naive", "single_buffer", "engine", "transport_alone", "bridge_export",
               "shared_weights")
# The refit modes that send through the refit engine's transport: with bench.fanouts they run
# once per fan-out strategy (naive sends its own broadcasts; shared_weights sends nothing).
FANOUT_MODES = ("single_buffer", "engine", "transport_alone", "bridge_export")
# Modes a launch without inference ranks (bench.trainer_only) can run.
EXPORT_MODES = ("export_alone", "bridge_export_alone")


@dataclass(frozen=True, kw_only=True)
class TargetsConfig:
    """The acceptance targets the summary line checks (``bench.targets``)."""

    # Non-colocated synthetic sets: this engine's GB/s over the raw link's.
    link_fraction: float = 0.85
    # Colocated synthetic sets: this engine's GB/s over a device-to-device copy's (dense, MoE).
    copy_fraction_dense: float = 0.35
    copy_fraction_moe: float = 0.25
    # Megatron source: the refit over the same refit from tensors in memory (transport alone).
    refit_over_transport: float = 1.15
    # Colocated on several GPUs: the refit over its floor (each GPU's ingress of the other ranks'
    # bytes, plus its own share at device-copy speed, measured in the same run).
    refit_over_floor: float = 1.15
    # Megatron source: Megatron-Bridge's export (or refit) over this export's (or refit's).
    speedup_over_bridge: float = 3.0
    # bench.engine=vllm: the refit over vLLM's own load of the same tensors from memory.
    refit_over_vllm_floor: float = 1.2

    def __post_init__(self) -> None:
        for key in ("link_fraction", "copy_fraction_dense", "copy_fraction_moe",
                    "refit_over_transport", "refit_over_floor", "speedup_over_bridge",
                    "refit_over_vllm_floor"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"`{key}` must be a positive number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to measure (the ``bench`` section)."""

    # A synthetic set generated on the trainer's device, or the Megatron model (``megatron``).
    source: SourceName = "dense_8b"
    modes: list[Mode] = field(default_factory=lambda: ["raw_link", "naive", "single_buffer",
                                                       "engine"])
    num_refits: int = 3
    num_warmup: int = 1
    # Run the whole list of modes this many times, one round after another; each mode's timed
    # repetitions are pooled over the rounds. A slow spell of a busy host then weighs on every
    # mode alike instead of on whichever mode it fell in (the ratios between modes steady).
    rounds: int = 1
    # Parameter dtype of synthetic sets.
    dtype: Dtype = "bfloat16"
    seed: int = 0
    raw_link_bytes: int = 1 << 30
    # One extra refit per mode comparing the engine's weights with the source's.
    verify: bool = True
    # Also append the JSON lines to this file.
    output: str | None = None
    # Non-colocated: the first ranks of the launch train, the others serve inference. One for a
    # synthetic set; for the Megatron source a multiple of megatron.parallel's tensor × pipeline
    # (data parallelism takes the rest).
    num_trainer_ranks: int = 1
    # Launch the trainer ranks only and time the export paths alone (export_alone,
    # bridge_export_alone): no inference process shares a device.
    trainer_only: bool = False
    # Non-colocated: run every refit mode once per fan-out strategy (refit.transport.fanout),
    # reported as mode/fanout (engine/broadcast, engine/relay, ...); null: the configured one.
    fanouts: list[Fanout] | None = None
    targets: TargetsConfig = field(default_factory=TargetsConfig)
    # What receives: tensors of the plan's shapes (the transport's own engine), or a vLLM
    # engine (source=megatron: vLLM starts from the model's HF config with dummy weights and
    # every refit brings the real ones through vLLM's loader).
    engine: Engine = "tensors"
    # engine=vllm on GPU: the fraction of device memory that must be free when vLLM starts.
    vllm_gpu_memory_utilization: float = 0.3

    def __post_init__(self) -> None:
        if self.engine not in typing.get_args(Engine):
            raise ConfigError(f"`engine` must be one of {', '.join(typing.get_args(Engine))}, "
                              f"got {self.engine!r}")
        if self.engine == "vllm":
            if self.source != "megatron":
                raise ConfigError(f"`engine`=vllm needs `source`=megatron (vLLM builds the "
                                  f"model's HF config), got {self.source!r}")
            refused = [m for m in self.modes if m == "naive"]
            if refused:
                raise ConfigError(f"`modes` {refused} do not run with `engine`=vllm")
            floor = [m for m in self.modes if m in VLLM_MODES]
            refits = [i for i, m in enumerate(self.modes) if m in REFIT_MODES]
            if floor and (not refits or refits[0] > self.modes.index(floor[0])):
                raise ConfigError("`modes` vllm_load_floor loads what the last refit brought: "
                                  "list a refit mode (engine, transport_alone, ...) before it")
        elif any(m in VLLM_MODES for m in self.modes):
            raise ConfigError("`modes` vllm_load_floor needs `engine`=vllm")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError(f"`vllm_gpu_memory_utilization` must be in (0, 1], got "
                              f"{self.vllm_gpu_memory_utilization!r}")
        if not self.modes or len(set(self.modes)) != len(self.modes):
            raise ConfigError(f"`modes` must be distinct entries of "
                              f"{', '.join(typing.get_args(Mode))}; got {self.modes}")
        for key in ("num_refits", "rounds", "raw_link_bytes", "num_trainer_ranks"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"`{key}` must be an integer ≥ 1, got {value!r}")
        if isinstance(self.num_warmup, bool) or not isinstance(self.num_warmup, int) or \
                self.num_warmup < 0:
            raise ConfigError(f"`num_warmup` must be an integer ≥ 0, got {self.num_warmup!r}")
        if "naive" in self.modes and self.source == "megatron":
            raise ConfigError("`modes` naive sends a synthetic set one tensor at a time; with "
                              "`source`=megatron, bridge_export is the export's baseline")
        bridge = [m for m in self.modes if m in BRIDGE_MODES]
        if bridge and self.source != "megatron":
            raise ConfigError(f"`modes` {bridge} measure Megatron-Bridge's export: they need "
                              f"`source`=megatron, got {self.source!r}")
        if self.fanouts is not None and (not self.fanouts
                                         or len(set(self.fanouts)) != len(self.fanouts)):
            raise ConfigError(f"`fanouts` must be distinct entries of "
                              f"{', '.join(typing.get_args(Fanout))}, or null; got {self.fanouts}")
        if self.trainer_only and any(m not in EXPORT_MODES for m in self.modes):
            raise ConfigError(f"`trainer_only`=true times the export paths alone: `modes` must "
                              f"be among {', '.join(EXPORT_MODES)}, got {self.modes}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True, kw_only=True)
class MegatronSourceConfig:
    """The trainer model for ``bench.source=megatron``, over the trainer ranks."""

    # A Hugging Face checkpoint directory; null builds `preset` with random weights instead.
    hf_path: str | None = None
    preset: Preset = "llama3_8b"
    # Keep only this many layers of the preset (null: all), for presets larger than the GPUs.
    num_layers: int | None = None
    # Load the checkpoint's weights (only with hf_path); false keeps Megatron's random init.
    load_weights: bool = False
    dtype: Dtype = "bfloat16"
    layer_spec: LayerSpec = "auto"
    # Tensor / pipeline / virtual-pipeline / expert sizes; bench.num_trainer_ranks must be a
    # multiple of tensor × pipeline × expert.
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.num_layers is not None and (isinstance(self.num_layers, bool)
                                            or self.num_layers < 1):
            raise ConfigError(f"`num_layers` must be a positive integer or null, got "
                              f"{self.num_layers!r}")


@dataclass(frozen=True, kw_only=True)
class RefitBenchJob:
    """Everything ``recipes/refit_bench.py`` reads from its YAML file."""

    bench: BenchConfig = field(default_factory=BenchConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    megatron: MegatronSourceConfig = field(default_factory=MegatronSourceConfig)

    def __post_init__(self) -> None:
        if self.bench.fanouts is not None and self.refit.mode != "non_colocated":
            raise ConfigError(f"`bench.fanouts` compares how buffers reach the inference ranks "
                              f"of a non-colocated run; got refit.mode={self.refit.mode}")
        colocated_only = [m for m in self.bench.modes if m in COLOCATED_MODES]
        if colocated_only and self.refit.mode != "colocated":
            raise ConfigError(f"`bench.modes` {', '.join(colocated_only)} needs "
                              f"refit.mode=colocated, got {self.refit.mode}")


@dataclass(frozen=True, kw_only=True)
class BenchLayout:
    """Where a benchmark's ranks sit: trainer ranks first, then inference ranks."""

    placement: str  # "colocated", "non_colocated" or "trainer_only"
    num_trainer_ranks: int
    num_inference_ranks: int
    # The Megatron source's layout (None for synthetic sets).
    parallel: ParallelConfig | None = None

    def as_dict(self) -> dict[str, Any]:
        layout: dict[str, Any] = {"trainer_ranks": self.num_trainer_ranks,
                                  "inference_ranks": self.num_inference_ranks}
        if self.parallel is not None:
            layout.update(tp=self.parallel.tensor, pp=self.parallel.pipeline,
                          vpp=self.parallel.virtual_pipeline,
                          dp=self.parallel.data_parallel_size(self.num_trainer_ranks))
            if self.parallel.expert > 1:
                layout["ep"] = self.parallel.expert
        return layout


def check_layout(job: RefitBenchJob, *, world_size: int) -> BenchLayout:
    """The layout of a launch of ``world_size`` ranks; ``ValueError`` naming the key otherwise.

    Colocated: every rank trains and spawns its engine. Non-colocated: the first
    ``bench.num_trainer_ranks`` ranks train, every other rank receives. Trainer-only: every rank
    trains.
    """
    bench, parallel = job.bench, job.megatron.parallel
    megatron = bench.source == "megatron"
    trainers = bench.num_trainer_ranks
    if not megatron and trainers != 1:
        raise ValueError(f"bench.num_trainer_ranks={trainers} needs bench.source=megatron: a "
                         f"synthetic set ({bench.source}) lives on one trainer rank")
    if megatron and trainers % parallel.model_parallel_size != 0:
        raise ValueError(f"bench.num_trainer_ranks={trainers} must be a multiple of "
                         f"megatron.parallel tensor × pipeline = {parallel.tensor} × "
                         f"{parallel.pipeline} (the trainer ranks hold the whole model, data "
                         f"parallelism takes the rest)")
    if megatron and trainers % (parallel.model_parallel_size * parallel.expert) != 0:
        raise ValueError(f"bench.num_trainer_ranks={trainers} must be a multiple of "
                         f"megatron.parallel tensor × pipeline × expert = {parallel.tensor} × "
                         f"{parallel.pipeline} × {parallel.expert} (expert parallelism splits "
                         "the data-parallel ranks)")
    layout = dict(num_trainer_ranks=trainers, parallel=parallel if megatron else None)
    if job.refit.mode == "colocated" or bench.trainer_only:
        placement = "colocated" if job.refit.mode == "colocated" else "trainer_only"
        if world_size != trainers:
            raise ValueError(f"a {placement} run launches exactly bench.num_trainer_ranks="
                             f"{trainers} ranks, got {world_size}")
        return BenchLayout(placement=placement, num_inference_ranks=0, **layout)
    if world_size <= trainers:
        raise ValueError(f"refit.mode=non_colocated needs an inference rank besides the "
                         f"bench.num_trainer_ranks={trainers} trainer ranks: launch more than "
                         f"{trainers} ranks (got {world_size})")
    return BenchLayout(placement="non_colocated", num_inference_ranks=world_size - trainers,
                       **layout)
