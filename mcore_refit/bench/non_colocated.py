"""The benchmark on a non-colocated job: trainer ranks send, inference ranks receive, or
trainer ranks only (``bench.trainer_only``: the export paths alone).

Every rank runs every mode, in order, from :data:`MODES` (what a trainer rank does, what an
inference rank does). Between modes and between refits ranks wait for each other on the host
(the control plane), never inside a device collective: a waiting NCCL kernel would slow down
whatever shares its GPU. A refit's time is trainer rank 0's, from the start exchange to the
outcome exchange (both span every rank); an export's is the slowest trainer rank's.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore_refit.bench.config import FANOUT_MODES
from mcore_refit.bench.rank import BenchRank, timed_refits
from mcore_refit.bench.results import (
    ModeResult,
    floor_result,
    fold_rows,
    progress,
    rank_row,
    transport_result,
)
from mcore_refit.bench.sources import BenchSources
from mcore_refit.bench.vllm import VllmBenchEngine, vllm_engine_args
from mcore_refit.control import ControlGroup, Outcome
from mcore_refit.non_colocated import NonColocatedJob
from mcore_refit.refit import (
    DeviceStreams,
    DigestRecorder,
    GroupCollectives,
    NonColocatedInitInfo,
    Refitter,
    TensorDictEngine,
    TransportOptions,
    create_sender,
    plan_for_source,
    spec_from_json,
    spec_to_json,
    transport_for,
    verify_engine_weights,
)


@dataclass
class NonColocatedBench(BenchRank):
    """One rank's view of a benchmark run on a non-colocated job."""

    launch: NonColocatedJob | None  # None: a trainer-only launch
    control: ControlGroup  # every rank of the launch
    trainers: ControlGroup  # the trainer ranks
    sources: BenchSources | None  # trainer ranks only
    vllm: VllmBenchEngine | None = None  # inference ranks with bench.engine=vllm, made once
    fanout: str | None = None  # the refit mode's fan-out (bench.fanouts), None: configured

    @property
    def options(self) -> TransportOptions:
        """The transport options of the mode running now."""
        options = self.job.refit.transport
        return options if self.fanout is None else dataclasses.replace(options,
                                                                       fanout=self.fanout)

    @property
    def is_trainer(self) -> bool:
        return self.launch is None or self.launch.is_trainer

    def vllm_engine(self) -> VllmBenchEngine:
        if self.vllm is None:
            self.vllm = VllmBenchEngine(**vllm_engine_args(self.job), device=self.device,
                                        options=self.job.refit.transport)
        return self.vllm

    @property
    def rank(self) -> int:
        return self.launch.global_rank if self.launch is not None else self.trainers.rank


def run_non_colocated(bench: NonColocatedBench) -> list[ModeResult] | None:
    """Every mode of ``bench.job.bench.modes`` (a refit mode once per ``bench.fanouts``, named
    ``mode/fanout``), ``bench.rounds`` times over; the results (one per mode and round) on
    trainer rank 0, else None."""
    results = []
    fanouts = bench.job.bench.fanouts
    for mode in bench.job.bench.modes * bench.job.bench.rounds:
        for fanout in fanouts if fanouts and mode in FANOUT_MODES else [None]:
            name = mode if fanout is None else f"{mode}/{fanout}"
            bench.fanout = fanout
            bench.control.barrier(what=f"every rank at the start of mode {name}",
                                  timeout_s=bench.job.refit.transport.start_timeout_s)
            role = MODES[mode]
            if bench.is_trainer:
                result = role.trainer(bench, mode)
                if result is not None and mode in FANOUT_MODES:
                    result.mode, result.fanout = name, bench.options.fanout
                results.append(result)
                if bench.rank == 0:
                    progress(results[-1])
            else:
                role.receiver(bench, mode)
            bench.synchronize()
    return results if bench.is_trainer and bench.rank == 0 else None


# --- raw link --------------------------------------------------------------------------------


def _raw_link(bench: NonColocatedBench, mode: str) -> ModeResult | None:
    """One ``raw_link_bytes`` broadcast from trainer rank 0 over its data group per repetition;
    the slowest member's time. Ranks outside the group wait on the host."""
    size = bench.job.bench.raw_link_bytes
    group = bench.launch.data_groups.get(0)
    payload = torch.ones(size, dtype=torch.uint8, device=bench.device) if group else None
    times = []
    for index in bench.repetitions():
        bench.control.barrier(what=f"the start of raw link broadcast {index}")
        started = time.perf_counter()
        if group is not None:
            GroupCollectives(group=group, streams=DeviceStreams(bench.device)).broadcast(
                payload, src_rank=0, what=f"the raw {size}-byte broadcast",
                timeout_s=bench.job.refit.transport.timeout_s)
        elapsed = time.perf_counter() - started if group is not None else 0.0
        slowest = max(bench.control.all_gather_json(elapsed, what="the raw link times"))
        if bench.timed(index):
            times.append(slowest)
    if not bench.is_trainer:
        return None
    if bench.rank == 0 and group is None:
        raise ValueError("raw_link needs an inference rank on another device than trainer "
                         "rank 0 (every inference rank shares its device)")
    return ModeResult(mode=mode, payload_bytes=size, refit_s=times, device=bench.device_name)


# --- one transfer per tensor -----------------------------------------------------------------


def _naive_trainer(bench: NonColocatedBench, mode: str) -> ModeResult:
    """One broadcast per tensor straight from the synthetic set, received into a fresh tensor
    and loaded (what a refit without packing or overlap does)."""
    source = bench.sources.main.source
    specs = source.weight_specs()
    bench.control.broadcast_json([spec_to_json(s) for s in specs], src=0,
                                 what="the naive mode's tensor specs")
    link = GroupCollectives(group=bench.launch.data_groups[0],
                            streams=DeviceStreams(bench.device))
    timeout_s = bench.job.refit.transport.timeout_s

    def once(digests: DigestRecorder | None = None) -> None:
        for _, tensor in source.iter_weights():
            tensor = tensor.contiguous()
            if digests is not None:
                digests(tensor)
            link.broadcast_async(tensor, src_rank=0, what="a per-tensor broadcast").wait_stream(
                link.streams, timeout_s=timeout_s)

    times = bench.time_repetitions(bench.control, once)
    verified = None
    if bench.job.bench.verify:
        digests = DigestRecorder(bench.device)
        once(digests)
        bench.control.broadcast_json(digests.table(len(specs)).tolist(), src=0,
                                     what="the sender's digests")
        verified = all(bench.control.all_gather_json(True, what="the naive mode's check"))
    return ModeResult(mode=mode, payload_bytes=sum(s.num_bytes for s in specs), refit_s=times,
                      device=bench.device_name, verified=verified, num_tensors=len(specs))


def _naive_receiver(bench: NonColocatedBench, mode: str) -> None:
    specs = [spec_from_json(s) for s in bench.control.broadcast_json(
        None, src=0, what="the naive mode's tensor specs")]
    engine = TensorDictEngine.from_specs(specs, device=bench.device)
    link = GroupCollectives(group=bench.launch.data_groups[0],
                            streams=DeviceStreams(bench.device))
    timeout_s = bench.job.refit.transport.timeout_s

    def once() -> None:
        for spec in specs:
            received = torch.empty(spec.shape, dtype=spec.dtype, device=bench.device)
            link.broadcast_async(received, src_rank=0, what="a per-tensor broadcast").wait_stream(
                link.streams, timeout_s=timeout_s)
            engine.load_weights([(spec.name, received)])

    bench.time_repetitions(bench.control, once)
    if bench.job.bench.verify:
        once()
        table = torch.tensor(bench.control.broadcast_json(None, src=0,
                                                          what="the sender's digests"))
        failure = verify_engine_weights(engine, specs, table.to(bench.device))
        bench.control.all_gather_json(failure is None, what="the naive mode's check")


# --- refits ----------------------------------------------------------------------------------


def _refit_trainer(bench: NonColocatedBench, mode: str) -> ModeResult:
    """Warm-up and timed refits of ``mode``'s source, then one verified refit.

    Every step a rank can fail in alone (capturing the source, allocating slots and engines)
    ends in an outcome exchange over every rank, and a failed refit raises on every rank, so
    all ranks leave the mode together and meet at its end-of-mode gather in step; the mode's
    error names the root failure and its rank first (:func:`fold_rows`).
    """
    job, launch = bench.job, bench.launch
    source = bench.sources.for_mode(mode)
    plan = plan_for_source(source, config=bench.plan_config(mode), device=bench.device)
    timed, verified, error = [], None, None
    try:
        _in_step(bench, f"capturing the source of {mode}", bench.sources.prepare, mode, plan)
        sender = create_sender(transport_for("non_colocated", bench.options), plan=plan,
                               placement=launch.placement, rank=launch.global_rank,
                               control=bench.control,
                               data_group=launch.data_groups.get(launch.global_rank),
                               links=launch.links, device=bench.device, options=bench.options,
                               cpu_device_id=f"bench{launch.global_rank}")
        with Refitter(source=source, sender=sender) as refitter:
            _in_step(bench, f"preparing the slots and engines of {mode}", refitter.prepare)
            for index in range(bench.num_refits()):
                verify = job.bench.verify and index == bench.num_refits() - 1
                telemetry = refitter.refit(verify=verify)
                if bench.timed(index):
                    timed.append(telemetry)
                if verify:
                    verified = telemetry.verified is True
    except Exception as failure:  # raised on every rank alike; the mode ends
        error, verified = failure, False
    received, message = fold_rows(
        bench.control.all_gather_json(rank_row([], error),
                                      what=f"the receivers' telemetry of {mode}"),
        mode=mode, name_of=launch.placement.name_of)
    return transport_result(mode, plan, timed, received, verified=verified,
                            device=bench.device_name, error=message)


def _refit_receiver(bench: NonColocatedBench, mode: str) -> None:
    launch, options = bench.launch, bench.options
    info = NonColocatedInitInfo(placement=launch.placement, receiver=launch.context.rank,
                                control=bench.control, data_groups=launch.data_groups,
                                links=launch.links)
    timed, error = [], None
    try:
        if bench.job.bench.engine == "vllm":
            # vLLM starts (once, at the first refit mode) while the trainers capture the source.
            _in_step(bench, f"capturing the source of {mode}", bench.vllm_engine)
            with bench.vllm.transfer(options) as transfer:
                _in_step(bench, f"preparing the slots and engines of {mode}",
                         transfer.init_weight_transfer_engine, info)
                for telemetry in timed_refits(transfer, num_refits=bench.num_refits(),
                                              first_timed=bench.job.bench.num_warmup,
                                              num_timed=bench.job.bench.num_refits):
                    timed.append(telemetry)
        else:
            _in_step(bench, f"capturing the source of {mode}", lambda: None)
            receiver = info.connect(device=bench.device, options=options, plan=None)
            with receiver:
                def ready() -> TensorDictEngine:
                    receiver.prepare()
                    return TensorDictEngine.from_specs(receiver.plan.specs(),
                                                       device=bench.device)

                engine = _in_step(bench, f"preparing the slots and engines of {mode}", ready)
                for index in range(bench.num_refits()):
                    telemetry = receiver.receive(engine)
                    if bench.timed(index):
                        timed.append(telemetry.as_dict())
    except Exception as failure:  # raised on every rank alike: the trainers report it
        error = failure
        print(f"bench: inference rank {launch.global_rank - launch.num_trainer_ranks}: {mode} "
              f"failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    bench.control.all_gather_json(rank_row(timed, error),
                                  what=f"the receivers' telemetry of {mode}")


def _in_step(bench: NonColocatedBench, what: str, action: Callable, *args):
    """``action(*args)`` on this rank, then its outcome shared with every rank of the launch:
    :class:`~mcore_refit.control.RankFailure` on every rank, naming the failing rank, if it
    failed on any."""
    outcome = Outcome.of(action, *args)
    bench.control.share_outcomes(outcome if not outcome.ok else Outcome(ok=True), what=what,
                                 who=bench.launch.placement.name_of)
    return outcome.value


# --- vLLM's own load -------------------------------------------------------------------------


def _floor_trainer(bench: NonColocatedBench, mode: str) -> ModeResult:
    """The slowest inference rank's load of the last refit's tensors by vLLM's loader, and the
    loader's figures (medians over ranks and repetitions)."""
    rows = [row for row in bench.control.all_gather_json(None, what="vLLM's load floor")
            if row is not None]
    return floor_result(mode, rows, device=bench.device_name)


def _floor_receiver(bench: NonColocatedBench, mode: str) -> None:
    times, payload, figures = bench.vllm_engine().load_floor(len(bench.repetitions()))
    warmup = bench.job.bench.num_warmup
    bench.control.all_gather_json([times[warmup:], payload, figures[warmup:]],
                                  what="vLLM's load floor")


# --- the export alone ------------------------------------------------------------------------


def _export_trainer(bench: NonColocatedBench, mode: str) -> ModeResult:
    return bench.time_export(bench.trainers, bench.sources, mode)


def _idle(bench: NonColocatedBench, mode: str) -> None:
    """An inference rank during a mode that involves the trainer ranks only."""


@dataclass(frozen=True)
class Roles:
    """What each kind of rank does in a mode."""

    trainer: Callable[[NonColocatedBench, str], ModeResult | None]
    receiver: Callable[[NonColocatedBench, str], None]


MODES: dict[str, Roles] = {
    "raw_link": Roles(trainer=_raw_link, receiver=_raw_link),
    "naive": Roles(trainer=_naive_trainer, receiver=_naive_receiver),
    "single_buffer": Roles(trainer=_refit_trainer, receiver=_refit_receiver),
    "engine": Roles(trainer=_refit_trainer, receiver=_refit_receiver),
    "transport_alone": Roles(trainer=_refit_trainer, receiver=_refit_receiver),
    "bridge_export": Roles(trainer=_refit_trainer, receiver=_refit_receiver),
    "export_alone": Roles(trainer=_export_trainer, receiver=_idle),
    "bridge_export_alone": Roles(trainer=_export_trainer, receiver=_idle),
    "vllm_load_floor": Roles(trainer=_floor_trainer, receiver=_floor_receiver),
}
