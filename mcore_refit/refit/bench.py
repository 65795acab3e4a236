"""Refit benchmark measurements (driven by ``recipes/refit_bench.py``).

Modes, each measured in the same run so ratios compare like with like:

- ``raw_link``: the limit. Non-colocated: one ``raw_link_bytes`` broadcast from the sender;
  colocated: a device-to-device copy of that size;
- ``naive``: one transfer per tensor. Non-colocated: a broadcast per tensor, received into a fresh
  tensor and loaded; colocated: the IPC protocol with one tensor per message (no packing);
- ``single_buffer``: this engine with one buffer (no overlap of export/pack and transfer);
- ``engine``: this engine as configured (``refit.num_buffers`` buffers);
- ``export_alone``: iterating the weight source with nothing else (the export's cost);
- ``transport_alone``: this engine from tensors materialised in advance (no export cost).

Every mode runs ``num_warmup`` untimed and ``num_refits`` timed refits, then (with ``verify``) one
verified refit that compares the engine's weights with the source's, bit for bit.

Placement (:func:`check_layout`): colocated, one rank and an engine process on its device;
non-colocated, ``bench.num_trainer_ranks`` trainer ranks and the rest inference ranks, joined
by a refit group of trainer rank 0 (the sender) and the inference ranks. Trainer ranks other
than the sender read the Megatron export in step with it (:func:`drain_non_colocated`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from queue import Empty
from typing import Any, Literal

import torch
import torch.distributed as dist

from mcore_refit.config import ParallelConfig
from mcore_refit.refit.bench_groups import BenchGroup, TrainerLockstep
from mcore_refit.refit.checksum import DigestRecorder, verify_engine_weights
from mcore_refit.refit.config import RefitConfig
from mcore_refit.refit.engines import TensorDictEngine
from mcore_refit.refit.plan import RefitPlan, build_plan
from mcore_refit.refit.refitter import plan_for_specs
from mcore_refit.refit.source import TensorSpec, WeightSource, drain
from mcore_refit.refit.synthetic import TensorListSource
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transport import RefitError

MODES = ("raw_link", "naive", "single_buffer", "engine", "export_alone", "transport_alone")
# Modes whose refits go through a RefitSender (and so have a plan and telemetry).
TRANSPORT_MODES = ("naive", "single_buffer", "engine", "transport_alone")
Source = Literal["dense_8b", "moe_30b_a3b", "tiny", "megatron"]
PHASES = ("export_s", "pack_s", "transfer_s", "load_s", "wait_s", "checksum_s")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """The ``bench`` section of the refit benchmark config."""

    # A synthetic set generated on the trainer's device, or the Megatron model (model section).
    source: Source = "dense_8b"
    modes: list[str] = field(default_factory=lambda: ["raw_link", "naive", "single_buffer",
                                                      "engine"])
    num_refits: int = 3
    num_warmup: int = 1
    # Parameter dtype of synthetic sets.
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    seed: int = 0
    raw_link_bytes: int = 1 << 30
    # One extra refit per mode comparing the engine's weights with the source's.
    verify: bool = True
    # Also append the JSON lines to this file.
    output: str | None = None
    # Non-colocated: the first ranks of the launch train, the others serve inference. One for a
    # synthetic set; for the Megatron source a multiple of megatron.parallel's tensor ×
    # pipeline (data parallelism takes the rest). Trainer rank 0 sends; the other trainer ranks
    # take part in the export and send nothing.
    num_trainer_ranks: int = 1

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"bench.modes must be distinct entries of {', '.join(MODES)}; "
                             f"got {self.modes}")
        for key in ("num_refits", "raw_link_bytes", "num_trainer_ranks"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"bench.{key} must be an integer ≥ 1, got {value!r}")
        if isinstance(self.num_warmup, bool) or not isinstance(self.num_warmup, int) or \
                self.num_warmup < 0:
            raise ValueError(f"bench.num_warmup must be an integer ≥ 0, got {self.num_warmup!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True, kw_only=True)
class BenchLayout:
    """Where a benchmark's ranks sit: trainer ranks first, then inference ranks."""

    placement: str
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
        return layout


def check_layout(*, placement: str, world_size: int, bench: BenchConfig,
                 parallel: ParallelConfig) -> BenchLayout:
    """The layout of a launch of ``world_size`` ranks; ``ValueError`` naming the key otherwise.

    Colocated: one rank, which trains (TP1×PP1) and spawns its engine. Non-colocated: the first
    ``bench.num_trainer_ranks`` ranks train, every other rank receives. ``parallel`` is the
    Megatron source's layout (``megatron.parallel``; ignored for synthetic sets).
    """
    megatron = bench.source == "megatron"
    trainers = bench.num_trainer_ranks
    if placement == "colocated":
        if world_size != 1 or trainers != 1:
            raise ValueError(f"refit.mode=colocated runs one rank (bench.num_trainer_ranks=1), "
                             f"got {world_size} ranks and bench.num_trainer_ranks={trainers}")
        if megatron and parallel.model_parallel_size != 1:
            raise ValueError(f"refit.mode=colocated builds the Megatron source on its one rank: "
                             f"megatron.parallel must be tensor=1, pipeline=1, got "
                             f"tensor={parallel.tensor}, pipeline={parallel.pipeline}")
        return BenchLayout(placement=placement, num_trainer_ranks=1, num_inference_ranks=0,
                           parallel=parallel if megatron else None)
    if world_size <= trainers:
        raise ValueError(f"refit.mode=non_colocated needs an inference rank besides the "
                         f"bench.num_trainer_ranks={trainers} trainer ranks: launch more than "
                         f"{trainers} ranks (got {world_size})")
    if not megatron and trainers != 1:
        raise ValueError(f"bench.num_trainer_ranks={trainers} needs bench.source=megatron: a "
                         f"synthetic set ({bench.source}) lives on one trainer rank")
    if megatron and trainers % parallel.model_parallel_size != 0:
        raise ValueError(f"bench.num_trainer_ranks={trainers} must be a multiple of "
                         f"megatron.parallel tensor × pipeline = {parallel.tensor} × "
                         f"{parallel.pipeline} (the trainer ranks hold the whole model, data "
                         f"parallelism takes the rest)")
    return BenchLayout(placement=placement, num_trainer_ranks=trainers,
                       num_inference_ranks=world_size - trainers,
                       parallel=parallel if megatron else None)


def mode_config(refit: RefitConfig, mode: str) -> RefitConfig:
    """The refit config a transport mode runs with."""
    if mode == "single_buffer":
        return dataclasses.replace(refit, num_buffers=1)
    if mode == "naive":
        # Every tensor exceeds a buffer of two alignment units: one tensor per message.
        return dataclasses.replace(refit, num_buffers=1, buffer_bytes=2 * refit.alignment_bytes,
                                   buffer_fraction=None)
    return refit


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def materialize(source: WeightSource) -> TensorListSource:
    """A copy of one pass of ``source`` kept in memory (transport without export)."""
    return TensorListSource([(name, tensor.detach().clone())
                             for name, tensor in source.iter_weights()])


# --- results ---------------------------------------------------------------------------------


@dataclass
class ModeResult:
    """One JSON line of the benchmark."""

    mode: str
    bytes: int
    refit_s: list[float]
    device: str
    verified: bool | None = None
    num_tensors: int | None = None
    num_buffers: int | None = None
    held_buffer_bytes: int | None = None
    phases: dict[str, float] = field(default_factory=dict)
    receiver_phases: dict[str, float] = field(default_factory=dict)
    peak_extra_bytes: int | None = None
    receiver_peak_extra_bytes: int | None = None
    new_allocations: int | None = None
    new_segments: int | None = None
    receiver_new_allocations: int | None = None
    receiver_new_segments: int | None = None
    error: str | None = None

    @property
    def refit_s_median(self) -> float:
        return statistics.median(self.refit_s) if self.refit_s else float("nan")

    @property
    def gbps(self) -> float:
        median = self.refit_s_median
        return self.bytes / median / 1e9 if median > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["refit_s_median"] = round(self.refit_s_median, 6)
        data["gbps"] = round(self.gbps, 3)
        data["refit_s"] = [round(s, 6) for s in self.refit_s]
        return {"mode": data.pop("mode"), **data}


def transport_result(mode: str, plan: RefitPlan, sender: list[RefitTelemetry],
                     receiver: list[dict], *, verified: bool | None, device: str) -> ModeResult:
    """Fold the timed refits' telemetry of both ends into one result."""
    result = ModeResult(mode=mode, bytes=plan.total_bytes, device=device,
                        refit_s=[t.total_s for t in sender], verified=verified,
                        num_tensors=plan.num_tensors, num_buffers=plan.num_buffers,
                        held_buffer_bytes=plan.held_bytes)
    result.phases = {p: round(statistics.median(getattr(t, p) for t in sender), 6)
                     for p in PHASES}
    if receiver:
        result.receiver_phases = {p: round(statistics.median(t[p] for t in receiver), 6)
                                  for p in PHASES}
    result.peak_extra_bytes = _max_or_none(t.peak_extra_bytes for t in sender)
    result.new_allocations = _sum_or_none(t.new_allocations for t in sender)
    result.new_segments = _sum_or_none(t.new_segments for t in sender)
    result.receiver_peak_extra_bytes = _max_or_none(t["peak_extra_bytes"] for t in receiver)
    result.receiver_new_allocations = _sum_or_none(t["new_allocations"] for t in receiver)
    result.receiver_new_segments = _sum_or_none(t["new_segments"] for t in receiver)
    return result


def summarize(results: list[ModeResult], *, source: str, placement: str,
              refit: RefitConfig, plan: RefitPlan | None) -> dict[str, Any]:
    """The last JSON line: every mode against the link, and the issue's targets."""
    by_mode = {r.mode: r for r in results}
    link = by_mode.get("raw_link")
    link_gbps = link.gbps if link is not None else None
    modes = {}
    for r in results:
        modes[r.mode] = {"gbps": round(r.gbps, 3), "refit_s_median": round(r.refit_s_median, 6),
                         "fraction_of_link": round(r.gbps / link_gbps, 4) if link_gbps else None,
                         "verified": r.verified}
    targets: dict[str, Any] = {}
    engine = by_mode.get("engine")
    if engine is not None and link_gbps and source != "megatron":
        needed = 0.85 if placement == "non_colocated" else (
            0.25 if source == "moe_30b_a3b" else 0.35)
        ratio = engine.gbps / link_gbps
        targets["transport_vs_link"] = {"ratio": round(ratio, 4), "target": needed,
                                        "met": ratio >= needed}
    export, transport = by_mode.get("export_alone"), by_mode.get("transport_alone")
    if engine is not None and export is not None and transport is not None and \
            source == "megatron":
        bound = max(export.refit_s_median, transport.refit_s_median)
        ratio = engine.refit_s_median / bound if bound > 0 else float("inf")
        targets["end_to_end_vs_max_export_transport"] = {
            "ratio": round(ratio, 4), "target": 1.15, "met": ratio <= 1.15,
            "export_s": round(export.refit_s_median, 6),
            "transport_s": round(transport.refit_s_median, 6)}
    if engine is not None and plan is not None and engine.peak_extra_bytes is not None:
        bound = (refit.num_buffers * plan.buffer_bytes + plan.largest_tensor_bytes
                 + 2 * plan.alignment_bytes)
        targets["peak_extra_memory"] = {"bytes": engine.peak_extra_bytes, "bound": bound,
                                        "met": engine.peak_extra_bytes <= bound}
    if engine is not None and engine.new_segments is not None:
        targets["no_new_allocations_after_first_refit"] = {
            "new_allocations": engine.new_allocations, "new_segments": engine.new_segments,
            "receiver_new_allocations": engine.receiver_new_allocations,
            "receiver_new_segments": engine.receiver_new_segments,
            "met": engine.new_segments == 0 and not engine.receiver_new_segments}
    return {"summary": True, "source": source, "placement": placement,
            "device": results[0].device if results else None,
            "raw_link_gbps": round(link_gbps, 3) if link_gbps else None,
            "modes": modes, "targets": targets,
            "all_verified": all(r.verified is not False for r in results)}


def emit(line: dict[str, Any], output: str | None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if output is not None:
        with open(output, "a") as handle:
            handle.write(text + "\n")


# --- limits ----------------------------------------------------------------------------------


def measure_raw_broadcast(link: BenchGroup, *, bench: BenchConfig) -> ModeResult:
    """One ``raw_link_bytes`` broadcast per refit, timed on all ranks. Collective."""
    payload = torch.ones(bench.raw_link_bytes, dtype=torch.uint8, device=link.device)

    def once() -> None:
        link.broadcast(payload, what=f"the raw {bench.raw_link_bytes}-byte broadcast")

    times = _timed_collective(once, link=link, bench=bench, what="raw_link")
    return ModeResult(mode="raw_link", bytes=bench.raw_link_bytes, refit_s=times,
                      device=device_name(link.device))


def measure_raw_copy(*, device: torch.device, bench: BenchConfig) -> ModeResult:
    """A device-to-device copy of ``raw_link_bytes`` per refit (the colocated limit)."""
    source = torch.ones(bench.raw_link_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = []
    for index in range(bench.num_warmup + bench.num_refits):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        if index >= bench.num_warmup:
            times.append(time.perf_counter() - start)
    return ModeResult(mode="raw_link", bytes=bench.raw_link_bytes, refit_s=times,
                      device=device_name(device))


def measure_export(source: WeightSource, *, device: torch.device, bench: BenchConfig,
                   num_bytes: int) -> ModeResult:
    """Iterate the source with nothing else (trainer ranks only)."""
    times = []
    for index in range(bench.num_warmup + bench.num_refits):
        synchronize(device)
        start = time.perf_counter()
        drain(source)
        synchronize(device)
        if index >= bench.num_warmup:
            times.append(time.perf_counter() - start)
    return ModeResult(mode="export_alone", bytes=num_bytes, refit_s=times,
                      device=device_name(device))


# --- naive non-colocated ---------------------------------------------------------------------

# One fixed description for every per-tensor broadcast (no string built per tensor).
NAIVE_BROADCAST = "a per-tensor broadcast of the naive mode"


def naive_broadcast_sender(source: WeightSource, *, link: BenchGroup, bench: BenchConfig,
                           specs: Sequence[TensorSpec]) -> ModeResult:
    """One broadcast per tensor, straight from the source. Collective with the receivers.

    Reads the source once per refit (:func:`num_refits_per_mode` passes in all), as trainer
    ranks that drain the export expect.
    """

    def once(digests: DigestRecorder | None = None) -> None:
        for _, tensor in source.iter_weights():
            tensor = tensor.contiguous()
            if digests is not None:
                digests(tensor)
            link.broadcast_in_order(tensor, what=NAIVE_BROADCAST)

    times = _timed_collective(once, link=link, bench=bench, what="naive")
    verified = None
    if bench.verify:
        digests = DigestRecorder(link.device)
        once(digests)
        link.broadcast(digests.table(len(specs)), what="the sender's weight digests")
        verified = link.all_ok(True, what="the naive mode's verification")
    return ModeResult(mode="naive", bytes=sum(s.num_bytes for s in specs), refit_s=times,
                      device=device_name(link.device), verified=verified,
                      num_tensors=len(specs))


def naive_broadcast_receiver(engine: TensorDictEngine, *, link: BenchGroup, bench: BenchConfig,
                             specs: Sequence[TensorSpec]) -> None:
    """Receive every tensor into a fresh tensor and load it. Collective with the sender."""

    def once() -> None:
        for spec in specs:
            received = torch.empty(spec.shape, dtype=spec.dtype, device=link.device)
            link.broadcast_in_order(received, what=NAIVE_BROADCAST)
            engine.load_weights([(spec.name, received)])

    _timed_collective(once, link=link, bench=bench, what="naive")
    if bench.verify:
        once()
        table = torch.zeros(len(specs), 3, dtype=torch.int64, device=link.device)
        link.broadcast(table, what="the sender's weight digests")
        failure = verify_engine_weights(engine, [s.name for s in specs], table)
        link.all_ok(failure is None, what="the naive mode's verification")


def num_refits_per_mode(bench: BenchConfig) -> int:
    """Refits (passes over the source) each exporting mode makes: warm-up, timed, verified."""
    return bench.num_warmup + bench.num_refits + (1 if bench.verify else 0)


def _timed_collective(once: Callable[[], None], *, link: BenchGroup, bench: BenchConfig,
                      what: str) -> list[float]:
    """Run ``once`` warm-up + timed times; each time is the slowest rank's."""
    times = []
    for index in range(bench.num_warmup + bench.num_refits):
        link.barrier(what=f"the start of {what} refit {index}")
        link.synchronize(what=f"the device before {what} refit {index}")
        start = time.perf_counter()
        once()
        link.synchronize(what=f"{what} refit {index}")
        elapsed = link.slowest(time.perf_counter() - start,
                               what=f"the time of {what} refit {index} on every rank")
        if index >= bench.num_warmup:
            times.append(elapsed)
    return times


# --- transport modes -------------------------------------------------------------------------


def run_sender_refits(refit_once: Callable[[bool], RefitTelemetry], *, bench: BenchConfig,
                      lockstep: TrainerLockstep | None = None
                      ) -> tuple[list[RefitTelemetry], bool | None, str | None]:
    """Warm-up and timed refits, then the verified one; returns (timed, verified, error).

    A failed refit ends the mode. With ``lockstep`` (a sender whose source is the export of
    several trainer ranks) every refit's outcome goes to the draining trainer ranks.
    """
    timed = []
    total = num_refits_per_mode(bench)
    verified = None
    for index in range(total):
        verify = bench.verify and index == total - 1
        try:
            telemetry, error = refit_once(verify), None
        except RefitError:
            telemetry, error = None, traceback.format_exc()
        if lockstep is not None:
            lockstep.after_refit(failed=error is not None, refit_index=index)
        if error is not None:
            return timed, False, error
        if bench.num_warmup <= index < bench.num_warmup + bench.num_refits:
            timed.append(telemetry)
        if verify:
            verified = telemetry.verified is True
    return timed, verified, None


def drain_refits(refit_once: Callable[[], Any], *, bench: BenchConfig,
                 lockstep: TrainerLockstep) -> None:
    """The draining trainer ranks' side of :func:`run_sender_refits` (same refits, in step)."""
    for index in range(num_refits_per_mode(bench)):
        refit_once()
        if lockstep.after_refit(failed=False, refit_index=index):
            return


def run_receiver_refits(receive_once: Callable[[], RefitTelemetry], *,
                        bench: BenchConfig) -> tuple[list[dict], str | None]:
    """The receiving side of :func:`run_sender_refits` (same number of refits)."""
    timed = []
    try:
        for index in range(num_refits_per_mode(bench)):
            telemetry = receive_once()
            if bench.num_warmup <= index < bench.num_warmup + bench.num_refits:
                timed.append(telemetry.as_dict())
    except RefitError:
        return timed, traceback.format_exc()
    return timed, None


def plan_for_mode(specs: Sequence[TensorSpec], refit: RefitConfig, mode: str, *,
                  device: torch.device) -> RefitPlan:
    return plan_for_specs(specs, config=mode_config(refit, mode), device=device)


def _max_or_none(values) -> int | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _sum_or_none(values) -> int | None:
    values = [v for v in values if v is not None]
    return sum(values) if values else None


# --- drivers ---------------------------------------------------------------------------------


def run_non_colocated_sender(*, source: WeightSource, specs: Sequence[TensorSpec],
                             bench: BenchConfig, refit: RefitConfig,
                             group: dist.ProcessGroup | None, src_rank: int, device: torch.device,
                             lockstep: TrainerLockstep | None = None) -> list[ModeResult]:
    """All of ``bench.modes``, sent from this process (group rank ``src_rank`` of the refit
    ``group``) to every other rank of the group; returns the results.

    Collective over ``group`` (with :func:`run_non_colocated_receiver` on the other ranks) and,
    with ``lockstep``, over the trainer ranks (with :func:`drain_non_colocated` on the others).
    """
    link = _bench_group(group, src_rank=src_rank, device=device, refit=refit)
    if not link.is_sender:
        raise ValueError(f"src_rank={src_rank} but this process is group rank {link.rank}")
    num_bytes = sum(s.num_bytes for s in specs)
    results = []
    for mode in bench.modes:
        if mode == "raw_link":
            results.append(measure_raw_broadcast(link, bench=bench))
        elif mode == "export_alone":
            results.append(measure_export(source, device=device, bench=bench,
                                          num_bytes=num_bytes))
        elif mode == "naive":
            results.append(naive_broadcast_sender(source, link=link, bench=bench, specs=specs))
        else:
            results.append(_send_transport_mode(mode, source, link=link, specs=specs,
                                                bench=bench, refit=refit, lockstep=lockstep))
        synchronize(device)
    return results


def run_non_colocated_receiver(*, specs: Sequence[TensorSpec], bench: BenchConfig,
                               refit: RefitConfig, group: dist.ProcessGroup | None,
                               src_rank: int, device: torch.device) -> None:
    """An inference rank of :func:`run_non_colocated_sender`: receives every mode into a
    preallocated engine. Collective over ``group``."""
    from mcore_refit.refit.broadcast import BroadcastReceiver

    link = _bench_group(group, src_rank=src_rank, device=device, refit=refit)
    engine = TensorDictEngine.from_specs(specs, device=device)
    for mode in bench.modes:
        if mode == "raw_link":
            measure_raw_broadcast(link, bench=bench)
        elif mode == "naive":
            naive_broadcast_receiver(engine, link=link, bench=bench, specs=specs)
        elif mode != "export_alone":
            receiver = BroadcastReceiver(group=group, src_rank=src_rank, device=device,
                                         config=mode_config(refit, mode))
            with receiver:
                receiver.prepare()
                timed, _ = run_receiver_refits(functools.partial(receiver.receive, engine),
                                               bench=bench)
            link.gather_json(timed, what=f"the receivers' telemetry of mode {mode}")
        synchronize(device)


def drain_non_colocated(*, source: WeightSource, specs: Sequence[TensorSpec],
                        bench: BenchConfig, refit: RefitConfig, device: torch.device,
                        lockstep: TrainerLockstep) -> None:
    """A trainer rank other than the sender: reads the export whenever the sender does.

    The Megatron export is a collective over the trainer ranks, so every pass the sender makes
    (per mode, per refit) is made here too, in step through ``lockstep``; nothing is sent.
    """
    from mcore_refit.refit.refitter import Refitter
    from mcore_refit.refit.transport import DrainSender

    for mode in bench.modes:
        if mode == "export_alone":
            measure_export(source, device=device, bench=bench, num_bytes=0)
        elif mode == "naive":
            for _ in range(num_refits_per_mode(bench)):
                drain(source)
        elif mode == "transport_alone":
            drain(source)  # the sender materialises one pass, then sends from memory
        elif mode != "raw_link":
            plan = plan_for_mode(specs, refit, mode, device=device)
            with Refitter(source=source, sender=DrainSender(plan=plan)) as refitter:
                refitter.prepare()
                drain_refits(refitter.refit, bench=bench, lockstep=lockstep)
        synchronize(device)


def _send_transport_mode(mode: str, source: WeightSource, *, link: BenchGroup,
                         specs: Sequence[TensorSpec], bench: BenchConfig, refit: RefitConfig,
                         lockstep: TrainerLockstep | None) -> ModeResult:
    from mcore_refit.refit.broadcast import BroadcastSender
    from mcore_refit.refit.refitter import Refitter

    device = link.device
    plan = plan_for_mode(specs, refit, mode, device=device)
    exports = mode != "transport_alone"
    mode_source = source if exports else materialize(source)
    sender = BroadcastSender(plan=plan, group=link.group, src_rank=link.src_rank, device=device,
                             config=mode_config(refit, mode))

    with Refitter(source=mode_source, sender=sender) as refitter:
        refitter.prepare()

        # A failed refit still reads its pass to the end (the sender drains the source), so the
        # trainer ranks draining the export in lockstep are never left inside it.
        timed, verified, error = run_sender_refits(lambda verify: refitter.refit(verify=verify),
                                                   bench=bench,
                                                   lockstep=lockstep if exports else None)
    del mode_source
    receivers = link.gather_json(None, what=f"the receivers' telemetry of mode {mode}")
    result = transport_result(mode, plan, timed, receivers[0] if receivers else [],
                              verified=verified, device=device_name(device))
    result.error = error
    return result


def _bench_group(group: dist.ProcessGroup | None, *, src_rank: int, device: torch.device,
                 refit: RefitConfig) -> BenchGroup:
    return BenchGroup(group, src_rank=src_rank, device=device, timeout_s=refit.timeout_s,
                      start_timeout_s=refit.start_timeout_s)


def run_colocated(*, source: WeightSource, specs: Sequence[TensorSpec], bench: BenchConfig,
                  refit: RefitConfig, device: torch.device,
                  cpu_device_id: str | None) -> list[ModeResult]:
    """All of ``bench.modes`` with the engine in a spawned process on the same device."""
    import torch.multiprocessing as mp

    from mcore_refit.refit.ipc import IpcSender
    from mcore_refit.refit.refitter import Refitter

    address = IpcSender.address_for(device=device, config=refit, cpu_device_id=cpu_device_id)
    transport_modes = [m for m in bench.modes if m in TRANSPORT_MODES]
    spec_plan = build_plan(specs, buffer_bytes=1 << 30, num_slots=1).to_json()
    context = mp.get_context("spawn")
    queue = context.Queue()
    engine = context.Process(target=colocated_engine_main,
                             args=(address, str(device), spec_plan, refit, bench,
                                   transport_modes, queue))
    engine.start()
    num_bytes = sum(s.num_bytes for s in specs)
    results = []
    try:
        for mode in bench.modes:
            if mode == "raw_link":
                results.append(measure_raw_copy(device=device, bench=bench))
            elif mode == "export_alone":
                results.append(measure_export(source, device=device, bench=bench,
                                              num_bytes=num_bytes))
            else:
                config = mode_config(refit, mode)
                plan = plan_for_mode(specs, refit, mode, device=device)
                mode_source = materialize(source) if mode == "transport_alone" else source
                sender = IpcSender(plan=plan, device=device, config=config,
                                   cpu_device_id=cpu_device_id)
                with Refitter(source=mode_source, sender=sender) as refitter:
                    refitter.prepare()
                    timed, verified, error = run_sender_refits(
                        lambda verify: refitter.refit(verify=verify), bench=bench)
                del mode_source
                try:
                    received = json.loads(queue.get(timeout=refit.timeout_s))
                except Empty:
                    received = {"telemetry": [], "error": "the engine process sent no results"}
                result = transport_result(mode, plan, timed, received["telemetry"],
                                          verified=verified, device=device_name(device))
                result.error = error or received["error"]
                results.append(result)
    finally:
        engine.join(refit.timeout_s)
        if engine.is_alive():
            engine.kill()
            engine.join()
    return results


def colocated_engine_main(address: str, device: str, spec_plan: str, refit: RefitConfig,
                          bench: BenchConfig, modes: list[str], queue) -> None:
    """The engine process of a colocated benchmark: one endpoint per transport mode."""
    from mcore_refit.refit.plan import plan_from_json
    from mcore_refit.refit.receiver import IpcInitInfo, WeightTransferEndpoint

    _exit_with_parent()
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    engine = TensorDictEngine.from_specs(plan_from_json(spec_plan).specs(), device=torch_device)
    for mode in modes:
        config = mode_config(refit, mode)
        with WeightTransferEndpoint(engine=engine, device=torch_device,
                                    config=config) as endpoint:
            endpoint.init_weight_transfer_engine(IpcInitInfo(address=address))

            def receive_once() -> RefitTelemetry:
                endpoint.start_weight_update()
                telemetry = endpoint.update_weights()
                endpoint.finish_weight_update(telemetry.refit_index)
                return telemetry

            timed, error = run_receiver_refits(receive_once, bench=bench)
        queue.put(json.dumps({"mode": mode, "telemetry": timed, "error": error}))


def _exit_with_parent() -> None:
    """End this process when its parent dies (a killed benchmark must not leave an engine
    holding GPU memory)."""
    import os
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()
