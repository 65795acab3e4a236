"""Refit benchmark: how fast do weights move from the trainer into an inference engine?

    # non-colocated: rank 0 is the trainer (GPU0), rank 1 the engine (GPU1)
    torchrun --nproc-per-node 2 recipes/refit_bench.py --config configs/refit_bench.yaml
    # 2 trainer ranks (Megatron at TP2) -> 2 inference ranks
    torchrun --nproc-per-node 4 recipes/refit_bench.py --config configs/refit_bench.yaml \
        bench.source=megatron bench.num_trainer_ranks=2 megatron.parallel.tensor=2
    # colocated: the engine is a process spawned on the trainer's GPU
    torchrun --nproc-per-node 1 recipes/refit_bench.py --config configs/refit_bench.yaml \
        refit.mode=colocated bench.source=moe_30b_a3b

Overrides are ``section.key=value`` (YAML values). Weights come from a synthetic set generated on
the trainer's device (``dense_8b``, ``moe_30b_a3b``, ``tiny``) or from a Megatron model through the
Megatron-Bridge export (``bench.source=megatron``; ``megatron.hf_path`` or a ``megatron.preset``
architecture with random weights, laid out as ``megatron.parallel`` over the trainer ranks).
Non-colocated launches split into ``bench.num_trainer_ranks`` trainer ranks and inference ranks
(the rest); Megatron's parallel state spans the trainer ranks only. Prints one JSON line per mode
(see :mod:`mcore_refit.refit.bench`), then a summary line; the exit code is 0 only when every
verified refit matched bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from mcore_refit.config import Dtype, LayerSpec, ParallelConfig, load_config
from mcore_refit.refit.bench import (
    BenchConfig,
    BenchLayout,
    ModeResult,
    check_layout,
    drain_non_colocated,
    emit,
    run_colocated,
    run_non_colocated_receiver,
    run_non_colocated_sender,
    summarize,
)
from mcore_refit.refit.bench_groups import TrainerLockstep
from mcore_refit.refit.config import RefitConfig
from mcore_refit.refit.group import GroupCollectives, RefitExchange
from mcore_refit.refit.plan import build_plan
from mcore_refit.refit.refitter import plan_for_specs
from mcore_refit.refit.source import TensorSpec
from mcore_refit.refit.streams import DeviceStreams
from mcore_refit.refit.synthetic import SyntheticWeightSource, synthetic_specs


@dataclass(frozen=True, kw_only=True)
class MegatronSourceConfig:
    """The Megatron trainer model for ``bench.source=megatron``, over the trainer ranks."""

    # A Hugging Face checkpoint directory; null builds `preset` with random weights instead.
    hf_path: str | None = None
    preset: Literal["llama3_8b", "tiny_llama"] = "llama3_8b"
    # Load the checkpoint's weights (only with hf_path); false keeps Megatron's random init.
    load_weights: bool = False
    dtype: Dtype = "bfloat16"
    layer_spec: LayerSpec = "auto"
    # Tensor / pipeline / virtual-pipeline sizes; bench.num_trainer_ranks must be a multiple of
    # tensor × pipeline.
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass(frozen=True, kw_only=True)
class RefitBenchJob:
    bench: BenchConfig = field(default_factory=BenchConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    megatron: MegatronSourceConfig = field(default_factory=MegatronSourceConfig)


@dataclass(frozen=True, kw_only=True)
class SenderOutcome:
    """What the sending rank reports: its results and the weight specs they were measured on."""

    results: list[ModeResult]
    specs: list[TensorSpec]
    device: torch.device


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="YAML config (defaults otherwise)")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    job = load_config(RefitBenchJob, args.config, args.overrides)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    layout = check_layout(placement=job.refit.mode, world_size=world_size, bench=job.bench,
                          parallel=job.megatron.parallel)
    if layout.placement == "colocated":
        outcome = run_colocated_job(job, local_rank=local_rank)
    else:
        outcome = run_split_job(job, layout, rank=rank, world_size=world_size,
                                local_rank=local_rank, store_host=os.environ["MASTER_ADDR"],
                                store_port=int(os.environ["MASTER_PORT"]))
    if outcome is None:
        return 0
    return report(job, layout, outcome)


def run_colocated_job(job: RefitBenchJob, *, local_rank: int) -> SenderOutcome:
    """One rank: the trainer, with its engine in a spawned process on the same device."""
    from mcore_refit import distributed

    if "MASTER_ADDR" not in os.environ:  # a single process started without torchrun
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    # The group's timeout bounds the engine's wait for a refit to start (NCCL's watchdog would
    # otherwise abort first).
    device = distributed.init_distributed(rank=0, world_size=1, local_rank=local_rank,
                                          timeout_s=job.refit.start_timeout_s + 60).device
    try:
        source, specs = _trainer_source(job, device=device)
        results = run_colocated(source=source, specs=specs, bench=job.bench, refit=job.refit,
                                device=device, cpu_device_id=_cpu_device_id(device))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return SenderOutcome(results=results, specs=specs, device=device)


def run_split_job(job: RefitBenchJob, layout: BenchLayout, *, rank: int, world_size: int,
                  local_rank: int, store_host: str, store_port: int) -> SenderOutcome | None:
    """Trainer ranks and inference ranks (see :func:`mcore_refit.distributed.init_split_job`);
    the sender's outcome on trainer rank 0, None elsewhere."""
    from mcore_refit import distributed

    # The groups' own timeout bounds the engines' wait for a refit to start (NCCL's watchdog
    # would otherwise abort first).
    split = distributed.init_split_job(
        rank=rank, world_size=world_size, local_rank=local_rank,
        num_inference_ranks=layout.num_inference_ranks, store_host=store_host,
        store_port=store_port, timeout_s=job.refit.start_timeout_s + 60)
    device, refit = split.context.device, job.refit
    common = dict(bench=job.bench, refit=refit, device=device)
    try:
        source, specs = _trainer_source(job, device=device) if split.is_trainer else (None, [])
        if split.refit_group is not None:
            specs = _share_specs(specs, group=split.refit_group, device=device,
                                 timeout_s=refit.start_timeout_s)
        lockstep = (TrainerLockstep(device=device, timeout_s=refit.start_timeout_s)
                    if split.is_trainer and split.num_trainer_ranks > 1 else None)
        if not split.is_trainer:
            run_non_colocated_receiver(specs=specs, group=split.refit_group, src_rank=0, **common)
            return None
        if split.refit_group is None:
            drain_non_colocated(source=source, specs=specs, lockstep=lockstep, **common)
            return None
        results = run_non_colocated_sender(source=source, specs=specs, group=split.refit_group,
                                           src_rank=0, lockstep=lockstep, **common)
        return SenderOutcome(results=results, specs=specs, device=device)
    finally:
        distributed.shutdown()


def report(job: RefitBenchJob, layout: BenchLayout, outcome: SenderOutcome) -> int:
    """Print (and append to ``bench.output``) a line per mode and the summary; the exit code."""
    refit, device = job.refit, outcome.device
    plan = plan_for_specs(outcome.specs, config=refit, device=device)
    where = {"source": job.bench.source, "placement": refit.mode, "layout": layout.as_dict()}
    for result in outcome.results:
        emit({**where, **result.as_dict()}, job.bench.output)
    summary = summarize(outcome.results, source=job.bench.source, placement=refit.mode,
                        refit=refit, plan=plan)
    emit({**summary, "layout": layout.as_dict()}, job.bench.output)
    return 0 if summary["all_verified"] and not any(r.error for r in outcome.results) else 1


def _trainer_source(job: RefitBenchJob, *, device: torch.device):
    """The weight source and its specs; call on every trainer rank (the Megatron source is built
    and exported collectively over them)."""
    bench = job.bench
    if bench.source != "megatron":
        specs = synthetic_specs(bench.source, dtype=bench.torch_dtype)
        return SyntheticWeightSource(specs, device=device, seed=bench.seed), specs
    return _megatron_source(job.megatron, device=device)


def _megatron_source(config: MegatronSourceConfig, *, device: torch.device):
    from mcore_refit import distributed
    from mcore_refit.config import ModelConfig

    # Megatron's groups span the default group: the trainer ranks of a split job, or the one
    # rank of a colocated run.
    distributed.init_model_parallel(config.parallel, seed=1234)
    from mcore_refit.model import build_model
    from mcore_refit.refit.source import BridgeWeightSource

    hf_path = config.hf_path
    if hf_path is None:
        hf_path = _write_preset_config(config.preset)
    model_config = ModelConfig(hf_path=hf_path, dtype=config.dtype,
                               layer_spec=config.layer_spec,
                               load_weights=config.load_weights and config.hf_path is not None)
    model = build_model(model_config, config.parallel, device=device)
    model.eval()
    source = BridgeWeightSource(model)
    return source, source.weight_specs()


def _write_preset_config(preset: str) -> str:
    """A config-only checkpoint directory for ``preset`` (random weights need no files)."""
    from transformers import LlamaConfig

    dims = {
        "llama3_8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                          rope_theta=500000.0, max_position_embeddings=8192),
        "tiny_llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                           max_position_embeddings=256),
    }[preset]
    config = LlamaConfig(**dims, tie_word_embeddings=False, rms_norm_eps=1e-5)
    config.architectures = ["LlamaForCausalLM"]
    path = tempfile.mkdtemp(prefix=f"refit_bench_{preset}_")
    config.save_pretrained(path)
    return path


def _share_specs(specs: list[TensorSpec], *, group: dist.ProcessGroup, device: torch.device,
                 timeout_s: float) -> list[TensorSpec]:
    """Trainer rank 0's specs on every rank of the refit group (as a plan, through the refit
    plan exchange). Collective over ``group``."""
    exchange = RefitExchange(GroupCollectives(group=group, streams=DeviceStreams(device)),
                             src_rank=0)
    plan = build_plan(specs, buffer_bytes=1 << 30, num_slots=1) if specs else None
    return exchange.share_plan(plan, timeout_s=timeout_s).specs()


def _cpu_device_id(device: torch.device) -> str | None:
    return None if device.type == "cuda" else f"cpu-{uuid.uuid4().hex[:12]}"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
