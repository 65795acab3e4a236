"""The benchmark on colocated ranks: every trainer rank spawns an engine process on its own
device and refits it through CUDA IPC (one engine per rank, as a colocated GRPO job runs).

Every rank runs every mode, in order; between modes and refits the ranks meet on the host (the
control plane). A refit's time is trainer rank 0's; a mode's limit (``raw_link``) is a
device-to-device copy of ``raw_link_bytes`` on each rank, the slowest rank's time.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_refit.bench.rank import BenchRank, receive_refits
from mcore_refit.bench.results import ModeResult, floor_result, progress, transport_result
from mcore_refit.bench.sources import BenchSources
from mcore_refit.bench.vllm import VllmBenchEngine, vllm_engine_args
from mcore_refit.control import ControlGroup, Outcome
from mcore_refit.inference.process import EngineProcess
from mcore_refit.refit import (
    ColocatedInitInfo,
    DeviceStreams,
    Refitter,
    TensorDictEngine,
    TransportOptions,
    WeightTransferEndpoint,
    create_sender,
    plan_for_source,
    plan_from_json,
    transport_for,
)


@dataclass
class ColocatedBench(BenchRank):
    """One trainer rank's view of a colocated benchmark run."""

    trainers: ControlGroup  # every rank of the launch (all of them train)
    sources: BenchSources
    cpu_device_id: str | None  # names this rank's IPC socket on CPU (every rank shares "cpu")


def run_colocated(bench: ColocatedBench) -> list[ModeResult] | None:
    """Every mode of ``bench.job.bench.modes``, ``bench.rounds`` times over; the results (one
    per mode and round) on rank 0, else None.

    Each rank's engine process lives for the whole run and receives every refit mode through a
    new endpoint; it holds one engine's weights (the specs of the main source).
    """
    job = bench.job
    # The engine holds the whole tensors of the main source (its plan is collective to build).
    plan = plan_for_source(bench.sources.main, config=job.refit.plan, device=bench.device)
    engine = bench.trainers.run_everywhere(
        "starting the benchmark engines", _start_engine, bench, plan.to_json(),
        who="trainer rank")
    results = []
    try:
        for mode in job.bench.modes * job.bench.rounds:
            bench.trainers.barrier(what=f"every rank at the start of mode {mode}",
                                   timeout_s=job.refit.transport.start_timeout_s)
            results.append(MODES[mode](bench, mode, engine))
            if bench.trainers.rank == 0:
                progress(results[-1])
            bench.synchronize()
    finally:
        engine.close()
    return results if bench.trainers.rank == 0 else None


def _start_engine(bench: ColocatedBench, plan_json: str) -> EngineProcess:
    spec = BenchEngineSpec(device=str(bench.device), transport=bench.job.refit.transport,
                           specs=plan_json,
                           vllm=(vllm_engine_args(bench.job) if bench.job.bench.engine == "vllm"
                                 else None))
    return EngineProcess(spec, timeout_s=bench.job.refit.transport.start_timeout_s,
                         liveness_s=bench.job.refit.transport.liveness_s,
                         server=BenchEngineServer)


# --- the limit -------------------------------------------------------------------------------


def _raw_copy(bench: ColocatedBench, mode: str, engine: EngineProcess) -> ModeResult:
    """A device-to-device copy of ``raw_link_bytes`` per repetition on every rank (the limit of
    a refit that stays on the device); the slowest rank's time."""
    size = bench.job.bench.raw_link_bytes
    source = torch.ones(size, dtype=torch.uint8, device=bench.device)
    target = torch.empty_like(source)

    def once() -> None:
        target.copy_(source)

    times = bench.time_repetitions(bench.trainers, once)
    result = ModeResult(mode=mode, payload_bytes=size, refit_s=times, device=bench.device_name)
    if bench.trainers.size > 1:
        result.ingress_gbps = _ingress_gbps(bench, size)
    return result


def _ingress_gbps(bench: ColocatedBench, size: int) -> float:
    """Each GPU's ingress from the others: an all-gather of ``size`` bytes over the trainer
    ranks (each receives (n − 1) / n of them), the slowest rank's time per repetition."""
    ranks = bench.trainers.size
    share = size // ranks
    mine = torch.ones(share, dtype=torch.uint8, device=bench.device)
    gathered = torch.empty(share * ranks, dtype=torch.uint8, device=bench.device)
    streams = DeviceStreams(bench.device)
    timeout_s = bench.job.refit.transport.timeout_s

    def once() -> None:
        work = dist.all_gather_into_tensor(gathered, mine, async_op=True)
        if not streams.is_cuda:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
            return
        work.wait()
        done = streams.new_event()
        streams.record(done)
        streams.host_wait(done, timeout_s=timeout_s, what="the ingress all-gather")

    times = bench.time_repetitions(bench.trainers, once)
    median = statistics.median(times)
    return round(share * (ranks - 1) / median / 1e9, 3) if median > 0 else 0.0


def _export(bench: ColocatedBench, mode: str, engine: EngineProcess) -> ModeResult:
    return bench.time_export(bench.trainers, bench.sources, mode)


# --- refits ----------------------------------------------------------------------------------


def _refit(bench: ColocatedBench, mode: str, engine: EngineProcess) -> ModeResult:
    """Warm-up and timed refits of ``mode``'s source into every rank's engine, then one
    verified refit. A failed refit ends the mode on every rank; its error is reported."""
    job, trainers = bench.job, bench.trainers
    source = bench.sources.for_mode(mode)
    plan = plan_for_source(source, config=bench.plan_config(mode), device=bench.device)
    several = trainers.size > 1
    options = job.refit.transport
    if mode == "shared_weights":
        options = dataclasses.replace(options, ipc_sharing="weights")
    sender = create_sender(transport_for("colocated", options), plan=plan, device=bench.device,
                           options=options, cpu_device_id=bench.cpu_device_id,
                           trainers=dist.group.WORLD if several else None,
                           control=trainers if several else None, rank=trainers.rank,
                           peer_alive=engine.alive_problem)
    timed, verified, error = [], None, None
    with Refitter(source=source, sender=sender) as refitter:
        engine.submit("receive", address=sender.address, num_refits=bench.num_refits(),
                      first_timed=job.bench.num_warmup, num_timed=job.bench.num_refits)
        refitter.prepare()
        for index in range(bench.num_refits()):
            verify = job.bench.verify and index == bench.num_refits() - 1
            outcome = Outcome.of(refitter.refit, verify=verify)
            if not outcome.ok:
                # Every rank took part in the whole refit; all of them end the mode.
                error = outcome.error
            failed = any(trainers.all_gather_json(not outcome.ok,
                                                  what=f"the outcome of {mode} refit {index}"))
            if failed:
                verified = False
                error = error or "another trainer rank's refit failed"
                break
            telemetry = outcome.value
            if bench.timed(index):
                timed.append(telemetry)
            if verify:
                verified = all(trainers.all_gather_json(
                    telemetry.verified is True, what=f"the verification of {mode}"))
    received = Outcome.of(engine.wait, "receive")
    if received.ok:
        receiver_rows, engine_error = received.value["telemetry"], received.value["error"]
    else:
        receiver_rows, engine_error = [], received.error
    result = transport_result(mode, plan, timed, receiver_rows, verified=verified,
                              device=bench.device_name, error=error or engine_error)
    # Every GPU's own share, a rank that sends nothing included (its floor is all ingress).
    result.source_bytes = [sum(b.wire_bytes for b in plan.buffers if b.source == rank)
                           for rank in range(trainers.size)]
    return result


def _floor(bench: ColocatedBench, mode: str, engine: EngineProcess) -> ModeResult:
    """Every rank's vLLM engine loads the last refit's tensors by its own loader; the slowest
    rank's time per repetition, and the loader's figures (medians over ranks and repetitions)."""
    times, payload, figures = engine.call("load_floor", repetitions=len(bench.repetitions()))
    warmup = bench.job.bench.num_warmup
    rows = bench.trainers.all_gather_json([times[warmup:], payload, figures[warmup:]],
                                          what="vLLM's load floor")
    return floor_result(mode, rows, device=bench.device_name)


MODES: dict[str, Callable[[ColocatedBench, str, EngineProcess], ModeResult]] = {
    "raw_link": _raw_copy,
    "naive": _refit,
    "single_buffer": _refit,
    "engine": _refit,
    "transport_alone": _refit,
    "bridge_export": _refit,
    "export_alone": _export,
    "bridge_export_alone": _export,
    "shared_weights": _refit,
    "vllm_load_floor": _floor,
}


# --- the engine process ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BenchEngineSpec:
    """What a benchmark engine process builds: a tensor engine for ``specs`` (a plan's JSON) on
    ``device``, or with ``vllm`` (:func:`~mcore_refit.bench.vllm.vllm_engine_args`) a vLLM
    engine, receiving with ``transport``'s options."""

    device: str
    transport: TransportOptions
    specs: str
    vllm: dict | None = None

    def to_json(self) -> dict:
        return {"device": self.device, "transport": dataclasses.asdict(self.transport),
                "specs": self.specs, "vllm": self.vllm}


class BenchEngineServer:
    """The commands of a benchmark engine process (see :class:`EngineProcess`)."""

    def __init__(self, spec_json: dict) -> None:
        self.device = torch.device(spec_json["device"])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.options = TransportOptions(**spec_json["transport"])
        self.vllm = (VllmBenchEngine(**spec_json["vllm"], device=self.device,
                                     options=self.options)
                     if spec_json.get("vllm") is not None else None)
        self.engine = (TensorDictEngine.from_specs(plan_from_json(spec_json["specs"]).specs(),
                                                   device=self.device)
                       if self.vllm is None else None)

    def do_receive(self, address: str, num_refits: int, first_timed: int,
                   num_timed: int) -> dict:
        """``num_refits`` refits from the sender at ``address``; the receiver telemetry of the
        timed ones, and the error that ended them early (None if none did)."""
        if self.vllm is not None:
            timed, error = self.vllm.receive(ColocatedInitInfo(address=address),
                                             num_refits=num_refits, first_timed=first_timed,
                                             num_timed=num_timed)
            return {"telemetry": timed, "error": error}
        with WeightTransferEndpoint(engine=self.engine, device=self.device,
                                    options=self.options) as endpoint:
            timed, error = receive_refits(endpoint, ColocatedInitInfo(address=address),
                                          num_refits=num_refits, first_timed=first_timed,
                                          num_timed=num_timed)
        return {"telemetry": timed, "error": error}

    def do_load_floor(self, repetitions: int) -> list:
        """vLLM's own load of the last refit's tensors: ``[seconds per repetition, bytes,
        the loader's figures per repetition]``."""
        if self.vllm is None:
            raise RuntimeError("vllm_load_floor needs bench.engine=vllm")
        return list(self.vllm.load_floor(repetitions))

    def close(self) -> None:
        pass
