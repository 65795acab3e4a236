"""What every benchmark driver shares: one rank's job, its repetitions and their timing."""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mcore_refit.bench.config import RefitBenchJob
from mcore_refit.bench.results import ModeResult
from mcore_refit.bench.sources import BenchSources, export_pass
from mcore_refit.control import ControlGroup
from mcore_refit.refit import DeviceStreams, PlanConfig, RefitError, plan_for_source


@dataclass
class BenchRank:
    """One rank of a benchmark run: the job and this rank's device."""

    job: RefitBenchJob
    device: torch.device

    def repetitions(self) -> range:
        """Warm-up then timed repetitions of a mode."""
        bench = self.job.bench
        return range(bench.num_warmup + bench.num_refits)

    def timed(self, index: int) -> bool:
        bench = self.job.bench
        return bench.num_warmup <= index < bench.num_warmup + bench.num_refits

    def num_refits(self) -> int:
        """Refits each refit mode makes: warm-up, timed, and one verified."""
        bench = self.job.bench
        return bench.num_warmup + bench.num_refits + (1 if bench.verify else 0)

    def synchronize(self) -> None:
        DeviceStreams(self.device).synchronize(timeout_s=self.job.refit.transport.timeout_s,
                                               what="the device")

    def plan_config(self, mode: str) -> PlanConfig:
        """The plan a refit mode runs with."""
        plan = self.job.refit.plan
        if mode == "single_buffer":
            return dataclasses.replace(plan, num_slots=1)
        if mode == "naive":
            # Every tensor exceeds a slot of two alignment units: one tensor per message.
            return dataclasses.replace(plan, num_slots=1, slot_bytes=2 * plan.alignment_bytes,
                                       slot_fraction=None)
        return plan

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def time_repetitions(self, control: ControlGroup, once: Callable[[], None]) -> list[float]:
        """``once`` per repetition on every rank of ``control``, which meet on the host first;
        each timed repetition's time is the slowest rank's."""
        times = []
        for index in self.repetitions():
            control.barrier(what=f"the start of repetition {index}")
            self.synchronize()
            started = time.perf_counter()
            once()
            self.synchronize()
            slowest = max(control.all_gather_json(time.perf_counter() - started,
                                                   what=f"the times of repetition {index}"))
            if self.timed(index):
                times.append(slowest)
        return times

    def time_export(self, trainers: ControlGroup, sources: BenchSources,
                    mode: str) -> ModeResult:
        """Passes over ``mode``'s source with nothing moved: each trainer rank reads what it would
        send (see :func:`export_pass`); the slowest trainer rank's time. Collective over
        ``trainers``."""
        source = sources.for_mode(mode)
        plan = plan_for_source(source, config=self.job.refit.plan, device=self.device)
        timeout_s = self.job.refit.transport.timeout_s
        times = self.time_repetitions(
            trainers, lambda: export_pass(source, plan, rank=trainers.rank, timeout_s=timeout_s))
        return ModeResult(mode=mode, payload_bytes=plan.payload_bytes, refit_s=times,
                          device=self.device_name, num_tensors=plan.num_tensors,
                          num_sources=len(plan.sources))


def receive_refits(endpoint, init_info, *, num_refits: int, first_timed: int,
                   num_timed: int) -> tuple[list[dict], str | None]:
    """``num_refits`` refits into ``endpoint`` (a ``WeightTransferEndpoint`` or a
    ``VllmWeightTransfer``: the same four calls) connected through ``init_info``; the receiver
    telemetry of the timed ones, and the error that ended them early (None if none did)."""
    timed = []
    try:
        endpoint.init_weight_transfer_engine(init_info)
        for telemetry in timed_refits(endpoint, num_refits=num_refits, first_timed=first_timed,
                                      num_timed=num_timed):
            timed.append(telemetry)
    except RefitError:
        return timed, traceback.format_exc()
    return timed, None


def timed_refits(endpoint, *, num_refits: int, first_timed: int,
                 num_timed: int) -> Iterator[dict]:
    """``num_refits`` refits into ``endpoint`` (connected: ``init_weight_transfer_engine``
    done); yields the receiver telemetry of refits ``first_timed`` to
    ``first_timed + num_timed - 1`` as each ends. A failed refit raises."""
    for index in range(num_refits):
        endpoint.start_weight_update()
        try:
            telemetry = endpoint.update_weights()
        finally:
            try:
                endpoint.finish_weight_update(index)
            except RefitError:
                pass  # the update failed: its error is the one reported
        if first_timed <= index < first_timed + num_timed:
            yield telemetry.as_dict()
