"""The refit benchmark: how fast weights move from the trainer into inference engines, measured
against the limit of the hardware in the same run (driven by ``recipes/refit_bench.py``).

Modes (``bench.modes``), each with ``num_warmup`` untimed and ``num_refits`` timed repetitions,
then (``verify``) one refit compared with the source bit for bit; the list runs ``rounds`` times
and each mode's timed repetitions are pooled:

- ``raw_link``: the limit. Non-colocated, one ``raw_link_bytes`` broadcast from trainer rank 0
  to the inference ranks on other devices; colocated, a device-to-device copy of that size;
- ``naive``: one transfer per tensor, unpacked (non-colocated: a broadcast per tensor of a
  synthetic set; colocated: the IPC protocol with one tensor per message);
- ``single_buffer``: this engine with one slot per source (no overlap of pack and transfer);
- ``engine``: this engine as configured;
- ``transport_alone``: this engine from the same tensors captured in memory (no export);
- ``export_alone``: the export with nothing moved (every trainer rank's reads; the slowest);
- ``bridge_export``, ``bridge_export_alone``: the same with Megatron-Bridge's own export (the
  baseline this project's export is measured against).

Layouts (:func:`~mcore_refit.bench.config.check_layout`): colocated (every rank trains and
spawns its engine, :mod:`.colocated`), non-colocated (trainer ranks, then inference ranks,
:mod:`.non_colocated`), and trainer-only (the export modes alone, with no engine on any device).
"""

from __future__ import annotations

import os

import torch

from mcore_refit import distributed
from mcore_refit.bench.colocated import ColocatedBench, run_colocated
from mcore_refit.bench.config import BenchLayout, RefitBenchJob, check_layout
from mcore_refit.bench.memory import check_bench_memory
from mcore_refit.bench.non_colocated import NonColocatedBench, run_non_colocated
from mcore_refit.bench.results import ModeResult, emit, pool_rounds, summarize
from mcore_refit.bench.sources import PRESETS, build_sources
from mcore_refit.control import ControlGroup
from mcore_refit.memory import gpu_capacities
from mcore_refit.non_colocated import init_non_colocated_job

__all__ = ["RefitBenchJob", "run_bench"]


def job_fanout(fanouts: list[str]) -> str:
    """The fan-out whose links a job must build to run every one of ``fanouts`` (the relay's
    links include the direct fan-out's)."""
    return next((name for name in ("relay", "direct") if name in fanouts), "broadcast")


def run_bench(job: RefitBenchJob, *, rank: int, world_size: int, local_rank: int,
              job_id: str) -> int:
    """Run ``job`` on this rank of a torchrun launch; the process exit code.

    Rank 0 prints one JSON line per mode and the summary (also appended to ``bench.output``);
    the exit code is 0 there only when every verified refit matched bit for bit and no mode
    failed. ``job_id`` names this launch's IPC sockets on CPU.
    """
    layout = check_layout(job, world_size=world_size)
    if torch.cuda.is_available():
        check_bench_memory(job, world_size=world_size, num_gpus=torch.cuda.device_count(),
                           capacity_of=gpu_capacities())
    timeout_s = job.refit.transport.start_timeout_s + 60
    if layout.placement == "non_colocated":
        launch = init_non_colocated_job(
            rank=rank, world_size=world_size, local_rank=local_rank,
            num_inference_ranks=layout.num_inference_ranks,
            store_host=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
            timeout_s=timeout_s,
            fanout=job_fanout(job.bench.fanouts or [job.refit.transport.fanout]))
        context = launch.context
    else:
        launch = None
        context = distributed.init_distributed(rank=rank, world_size=world_size,
                                               local_rank=local_rank, timeout_s=timeout_s)
    sources = None
    try:
        control_timeout = job.refit.transport.start_timeout_s
        trainers = ControlGroup(context.control_group, timeout_s=control_timeout,
                                name="the trainer ranks' control group")
        is_trainer = launch is None or launch.is_trainer
        sources = (trainers.run_everywhere("building the benchmark's sources", build_sources,
                                           job, device=context.device, control=trainers,
                                           who="trainer rank")
                   if is_trainer else None)
        if layout.placement == "colocated":
            cpu_id = f"{job_id}-rank{rank}" if context.device.type == "cpu" else None
            results = run_colocated(ColocatedBench(job=job, trainers=trainers,
                                                   device=context.device, sources=sources,
                                                   cpu_device_id=cpu_id))
        else:
            control = (ControlGroup(launch.refit_control, timeout_s=control_timeout,
                                    name="the benchmark's control group")
                       if launch is not None else trainers)
            results = run_non_colocated(NonColocatedBench(
                job=job, launch=launch, control=control, trainers=trainers,
                device=context.device, sources=sources))
    finally:
        if sources is not None:
            sources.close()
        distributed.shutdown()
    if results is None:
        return 0
    return report(job, layout, results)


def report(job: RefitBenchJob, layout: BenchLayout, results: list[ModeResult]) -> int:
    """Print (and append to ``bench.output``) a line per mode (its rounds pooled) and the
    summary; the exit code."""
    results = pool_rounds(results)
    model = _model_description(job)
    where = {"source": job.bench.source, "placement": layout.placement,
             "layout": layout.as_dict(), **model}
    for result in results:
        emit({**where, **result.as_dict()}, job.bench.output)
    summary = summarize(results, source=job.bench.source, placement=layout.placement,
                        targets=job.bench.targets,
                        alignment_bytes=job.refit.plan.alignment_bytes)
    emit({**summary, "layout": layout.as_dict(), **model}, job.bench.output)
    return 0 if summary["all_verified"] and not any(r.error for r in results) else 1


def _model_description(job: RefitBenchJob) -> dict:
    """For a Megatron preset: which one, and at how many of its layers (a preset larger than
    the GPUs runs at fewer layers, and the output says so)."""
    megatron = job.megatron
    if job.bench.source != "megatron" or megatron.hf_path is not None:
        return {}
    depth = PRESETS[megatron.preset][1]["num_hidden_layers"]
    layers = megatron.num_layers if megatron.num_layers is not None else depth
    return {"model": {"preset": megatron.preset, "num_layers": layers, "preset_layers": depth,
                      "full_depth": layers == depth}}
