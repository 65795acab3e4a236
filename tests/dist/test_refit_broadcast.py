"""Non-colocated transport on CPU (gloo, 2-4 real processes): bitwise round trips and failures.

Every scenario runs in fresh processes on a free port; each rank writes a JSON result
that the test asserts on. The ranks form a non-colocated job by hand: trainer ranks first, then
inference ranks, a control group over all of them and a data group per source trainer rank.
Failures must reach every rank as a RefitError naming the rank, within the configured timeout.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from mcore_refit.bench.synthetic import SyntheticWeightSource, TensorListSource, tiny_mixed_specs
from mcore_refit.control import ControlGroup
from mcore_refit.refit import (
    LocalSource,
    NonColocatedInitInfo,
    NonColocatedSender,
    Placement,
    PlanConfig,
    RefitError,
    Refitter,
    SourceLayout,
    TensorDictEngine,
    TensorSpec,
    TransportOptions,
    WeightTransferEndpoint,
    build_plan,
    plan_for_source,
)
from tests.ranks import run_ranks
from tests.tensors import bits

CPU = torch.device("cpu")


def _plan_config(**overrides) -> PlanConfig:
    return PlanConfig(**{"slot_bytes": 2048, "num_slots": 2, **overrides})


def _options(**overrides) -> TransportOptions:
    values = {"checksums": True, "timeout_s": 10.0, "start_timeout_s": 20.0}
    return TransportOptions(**{**values, **overrides})


class _Job:
    """The non-colocated job's groups, built by hand on a gloo world of trainers then receivers."""

    def __init__(self, rank: int, *, trainers: int, receivers: int, shared=()) -> None:
        self.rank = rank
        self.placement = Placement(num_trainers=trainers, num_receivers=receivers,
                                   shared=frozenset(shared))
        self.control = ControlGroup(None, timeout_s=30)
        self.data_groups = {}
        for source in range(trainers):
            members = [source] + [trainers + r for r in self.placement.remote_receivers(source)]
            group = dist.new_group(members) if len(members) > 1 else None
            if rank in members and group is not None:
                self.data_groups[source] = group

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.placement.num_trainers

    @property
    def receiver(self) -> int:
        return self.rank - self.placement.num_trainers

    def sender(self, plan, options, **kwargs) -> NonColocatedSender:
        return NonColocatedSender(plan=plan, placement=self.placement, rank=self.rank,
                               control=self.control, data_group=self.data_groups.get(self.rank),
                               device=CPU, options=options,
                               cpu_device_id=f"t{os.getpid()}", **kwargs)

    def endpoint(self, engine, options, plan=None) -> WeightTransferEndpoint:
        endpoint = WeightTransferEndpoint(engine=engine, device=CPU, options=options, plan=plan)
        endpoint.init_weight_transfer_engine(NonColocatedInitInfo(
            placement=self.placement, receiver=self.receiver, control=self.control,
            data_groups={s: g for s, g in self.data_groups.items() if s != self.rank}))
        return endpoint


class _ShardedSource:
    """Tensors spread over the trainer ranks: tensor ``i`` belongs to trainer rank ``owners[i]``;
    every rank knows every spec and yields its own tensors (the plan keeps their order)."""

    stable_tensors = False

    def __init__(self, named, owners, *, rank: int, fail_at: str | None = None) -> None:
        self._named, self._owners, self._rank, self._fail_at = named, owners, rank, fail_at

    def layout(self) -> SourceLayout:
        return SourceLayout(specs=[TensorSpec.of(n, t) for n, t in self._named],
                            sources=list(self._owners))

    def begin(self, plan):
        return self

    def exchange(self, buffer, *, timeout_s: float) -> None:
        pass

    def own_weights(self):
        for (name, tensor), owner in zip(self._named, self._owners, strict=True):
            if owner != self._rank:
                continue
            if name == self._fail_at:
                raise RuntimeError(f"trainer rank {self._rank}'s export broke at {name}")
            yield name, tensor


def _bump(source) -> None:
    """Change every value, so a later refit must deliver new bytes (stale data would show)."""
    for _, tensor in source.iter_weights():
        tensor.add_(1)


def _attempt(action) -> dict:
    try:
        return {"ok": True, "value": action()}
    except RefitError as error:
        return {"ok": False, "type": type(error).__name__, "message": str(error)}


def _receive_checks(job, specs, options, expected_of, *, versions=(1, 2)) -> list[dict]:
    engine = TensorDictEngine.from_specs(specs, device=CPU)
    checks = []
    with job.endpoint(engine, options) as endpoint:
        for version in versions:
            endpoint.start_weight_update()
            telemetry = endpoint.update_weights()
            endpoint.finish_weight_update(version)
            expected = expected_of(version)
            checks.append({
                "bitwise": all(torch.equal(bits(engine.get_weight(n)), bits(t))
                               for n, t in expected),
                "verified": telemetry.verified, "version": endpoint.weight_version,
                "refit_index": telemetry.refit_index})
    return checks


# --- scenarios (run inside fresh ranks) -------------------------------------------------------


def one_source(rank: int, num_slots_list: list[int]) -> dict:
    """Trainer rank 0 sends the tiny mixed set (non-contiguous) twice per slot count to two
    inference ranks; the receivers check bitwise."""
    job = _Job(rank, trainers=1, receivers=2)
    specs = tiny_mixed_specs()
    out = {}
    for num_slots in num_slots_list:
        options = _options()

        def expected_of(version, seed=num_slots):
            source = SyntheticWeightSource(specs, device=CPU, seed=seed, noncontiguous=True)
            if version == 2:
                _bump(source)
            return list(source.iter_weights())

        if job.is_trainer:
            source = SyntheticWeightSource(specs, device=CPU, seed=num_slots, noncontiguous=True)
            local = LocalSource(source)
            plan = plan_for_source(local, config=_plan_config(num_slots=num_slots), device=CPU)
            with Refitter(source=local, sender=job.sender(plan, options)) as refitter:
                refitter.prepare()
                first = refitter.refit(verify=True).as_dict()
                _bump(source)
                second = refitter.refit(verify=False).as_dict()
            out[num_slots] = {"telemetry": [first, second], "num_buffers": plan.num_buffers,
                              "oversized": sum(b.oversized for b in plan.buffers)}
        else:
            out[num_slots] = _receive_checks(job, specs, options, expected_of)
    return out


def sharded_round_trip(job, options, *, seed: int, noncontiguous: bool = False) -> tuple:
    """Tensor ``i`` of the tiny mixed set on trainer rank ``i % trainers``, refitted twice
    (every value changed in between); receivers check bitwise. ``(report, plan)``; the plan is
    None on receivers."""
    specs = tiny_mixed_specs()
    owners = [i % job.placement.num_trainers for i in range(len(specs))]

    def named(version):
        source = SyntheticWeightSource(specs, device=CPU, seed=seed, noncontiguous=noncontiguous)
        if version == 2:
            _bump(source)
        return list(source.iter_weights())

    if not job.is_trainer:
        return {"checks": _receive_checks(job, specs, options, named)}, None
    tensors = named(1)
    source = _ShardedSource(tensors, owners, rank=job.rank)
    plan = plan_for_source(source, config=_plan_config(), device=CPU)
    telemetry = []
    with Refitter(source=source, sender=job.sender(plan, options)) as refitter:
        refitter.prepare()
        telemetry.append(refitter.refit(verify=True).as_dict())
        for _, tensor in tensors:
            tensor.add_(1)
        telemetry.append(refitter.refit().as_dict())
    return {"telemetry": telemetry}, plan


def two_sources(rank: int, shared: list) -> dict:
    """Two trainer ranks each send their half of the set (every other tensor) to two inference
    ranks; with ``shared``, a trainer rank and an inference rank share a device (IPC)."""
    job = _Job(rank, trainers=2, receivers=2, shared={tuple(p) for p in shared})
    report, plan = sharded_round_trip(job, _options(), seed=11)
    if plan is not None:
        report.update(sources=list(plan.sources),
                      buffers_by_source=[sum(b.source == s for b in plan.buffers)
                                         for s in (0, 1)])
    return report


def source_fails(rank: int) -> dict:
    """Trainer rank 1's export breaks in the middle of the refit: every rank raises, naming it;
    the next refit goes through."""
    job = _Job(rank, trainers=2, receivers=1)
    specs = tiny_mixed_specs()
    options = _options(timeout_s=5.0)
    source = SyntheticWeightSource(specs, device=CPU, seed=3)
    named = list(source.iter_weights())
    owners = [i % 2 for i in range(len(specs))]
    out = {}
    if job.is_trainer:
        plan = plan_for_source(_ShardedSource(named, owners, rank=rank), config=_plan_config(),
                               device=CPU)
        own = [n for n, o in zip(plan.names, plan.tensor_sources(), strict=True) if o == 1]
        with Refitter(source=_ShardedSource(named, owners, rank=rank),
                      sender=job.sender(plan, options)) as refitter:
            refitter.prepare()
            for case, fail_at in (("broken", own[len(own) // 2]), ("healthy", None)):
                refitter.source = _ShardedSource(named, owners, rank=rank,
                                                 fail_at=fail_at if rank == 1 else None)
                started = time.monotonic()
                out[case] = _attempt(lambda: refitter.refit(verify=True).verified)
                out[case]["elapsed_s"] = time.monotonic() - started
        return out
    engine = TensorDictEngine.from_specs(specs, device=CPU)
    with job.endpoint(engine, options) as endpoint:
        for case in ("broken", "healthy"):
            started = time.monotonic()
            endpoint.start_weight_update()
            out[case] = _attempt(lambda: endpoint.update_weights().verified)
            out[case]["finish"] = _attempt(lambda: endpoint.finish_weight_update(1)).get(
                "message")
            out[case]["elapsed_s"] = time.monotonic() - started
    out["bitwise"] = all(torch.equal(bits(engine.get_weight(n)), bits(t)) for n, t in named)
    return out


class _ExplodingEngine(TensorDictEngine):
    """Raises (or kills its process) on the n-th load_weights call."""

    def __init__(self, targets, *, fail_on_call: int, kill: bool) -> None:
        super().__init__(targets, description="the exploding engine")
        self._calls = 0
        self._fail_on_call = fail_on_call
        self._kill = kill

    def load_weights(self, weights) -> None:
        self._calls += 1
        if self._calls == self._fail_on_call:
            if self._kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"engine exploded on load_weights call {self._calls}")
        super().load_weights(weights)


class _CountingSource(LocalSource):
    """A one-rank source counting the tensors refits read from it."""

    def __init__(self, source) -> None:
        super().__init__(source)
        self.read = 0

    def begin(self, plan):
        refit_pass = super().begin(plan)
        weights = refit_pass.own_weights

        def counted():
            for item in weights():
                self.read += 1
                yield item

        refit_pass.own_weights = counted
        return refit_pass


def failures(rank: int) -> dict:
    """Plan mismatch, unknown name, receiver raising, sender's source drifting — each a clean
    RefitError on both ranks; then a normal refit proves the groups are still healthy."""
    job = _Job(rank, trainers=1, receivers=1)
    specs = tiny_mixed_specs()
    options = _options()
    source = SyntheticWeightSource(specs, device=CPU, seed=9)
    plan = plan_for_source(LocalSource(source), config=_plan_config(), device=CPU)
    healthy = TensorDictEngine.from_specs(specs, device=CPU)

    def targets():
        return {n: healthy.get_weight(n).clone() for n in healthy.names}

    cases = {
        "plan_mismatch": {"engine": healthy,
                          "plan": build_plan(specs, slot_bytes=4096, num_slots=2)},
        "unknown_name": {"engine": TensorDictEngine.from_specs(specs[:-1], device=CPU)},
        "receiver_raises": {"engine": _ExplodingEngine(targets(), fail_on_call=2, kill=False)},
        "source_drift": {"engine": healthy,
                         "source": TensorListSource([(n, t.double() if n == "layers.0.step"
                                                      else t) for n, t in
                                                     source.iter_weights()])},
        "healthy_again": {"engine": healthy},
    }
    out = {}
    for name, case in cases.items():
        started = time.monotonic()
        if job.is_trainer:
            counted = _CountingSource(case.get("source", source))
            with Refitter(source=counted, sender=job.sender(plan, options)) as refitter:
                refitter.prepare()
                out[name] = _attempt(lambda: refitter.refit(verify=True).verified)
            out[name]["read"] = counted.read
        else:
            with job.endpoint(case["engine"], options, plan=case.get("plan")) as endpoint:
                endpoint.start_weight_update()
                out[name] = _attempt(lambda: endpoint.update_weights().verified)
                finish = _attempt(lambda: endpoint.finish_weight_update(1))
                out[name]["finish"] = finish.get("message")
        out[name]["elapsed_s"] = time.monotonic() - started
    return out


def _timed_failing_refit(job, specs, options) -> dict:
    """Sender side of the receiver-failure scenarios: one refit's outcome and its duration."""
    source = LocalSource(SyntheticWeightSource(specs, device=CPU, seed=2))
    plan = plan_for_source(source, config=_plan_config(), device=CPU)
    with Refitter(source=source, sender=job.sender(plan, options)) as refitter:
        refitter.prepare()
        started = time.monotonic()
        result = _attempt(lambda: refitter.refit().total_s)
        result["elapsed_s"] = time.monotonic() - started
        return result


def dead_receiver(rank: int) -> dict:
    """The receiver's process is SIGKILLed while loading the second buffer."""
    job = _Job(rank, trainers=1, receivers=1)
    specs = tiny_mixed_specs()
    options = _options(timeout_s=5.0)
    if job.is_trainer:
        return _timed_failing_refit(job, specs, options)
    targets = TensorDictEngine.from_specs(specs, device=CPU)
    engine = _ExplodingEngine({n: targets.get_weight(n) for n in targets.names},
                              fail_on_call=2, kill=True)
    with job.endpoint(engine, options) as endpoint:
        endpoint.start_weight_update()
        endpoint.update_weights()
    return {"unreachable": True}


def absent_receiver(rank: int) -> dict:
    """The receiver prepares, then never joins the refit: the sender times out."""
    job = _Job(rank, trainers=1, receivers=1)
    specs = tiny_mixed_specs()
    options = _options(timeout_s=2.0, start_timeout_s=2.0)
    if job.is_trainer:
        return _timed_failing_refit(job, specs, options)
    engine = TensorDictEngine.from_specs(specs, device=CPU)
    with job.endpoint(engine, options):
        time.sleep(6.0)
    return {"slept": True}


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_one_source_round_trip_bitwise(tmp_path):
    results = run_ranks(one_source, 3, tmp_path, [1, 2, 3], timeout_s=100)
    sender = results[0]
    assert "uncaught" not in sender, sender
    for num_slots in ("1", "2", "3"):
        report = sender[num_slots]
        assert report["oversized"] >= 1  # the plan has tensors larger than a slot
        first, second = report["telemetry"]
        assert first["verified"] is True and first["checksums"] is True
        assert first["payload_bytes"] == sum(s.num_bytes for s in tiny_mixed_specs())
        assert first["num_buffers"] == report["num_buffers"] > 1
        assert (first["refit_index"], second["refit_index"]) == (0, 1)
        for rank in (1, 2):
            checks = results[rank][num_slots]
            assert [c["bitwise"] for c in checks] == [True, True], (rank, num_slots)
            assert [c["verified"] for c in checks] == [True, None]
            assert [c["version"] for c in checks] == [1, 2]
            assert [c["refit_index"] for c in checks] == [0, 1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shared", [[], [[1, 0]]], ids=["broadcast", "ipc_for_rank1_to_0"])
def test_two_sources_round_trip_bitwise(tmp_path, shared):
    results = run_ranks(two_sources, 4, tmp_path, shared, timeout_s=100)
    for rank in (0, 1):
        report = results[rank]
        assert "uncaught" not in report, report
        assert report["sources"] == [0, 1] and min(report["buffers_by_source"]) > 1
        assert [t["refit_index"] for t in report["telemetry"]] == [0, 1]
        assert report["telemetry"][0]["verified"] is True
    for rank in (2, 3):
        checks = results[rank]["checks"]
        assert [c["bitwise"] for c in checks] == [True, True], (rank, results[rank])
        assert [c["verified"] for c in checks] == [True, None]


@pytest.mark.timeout(90)
def test_a_failing_source_other_than_rank_0_fails_every_rank(tmp_path):
    results = run_ranks(source_fails, 3, tmp_path, timeout_s=80)
    for rank in range(3):
        side = results[rank]
        assert "uncaught" not in side, side
        broken = side["broken"]
        assert broken["ok"] is False and broken["type"] == "RefitError", (rank, side)
        assert broken["message"].startswith("refit 0 failed on trainer rank 1: packing "
                                            "buffer "), broken["message"]
        assert "RuntimeError: trainer rank 1's export broke at" in broken["message"]
        assert broken["elapsed_s"] < 5.0
        assert side["healthy"]["ok"] is True and side["healthy"]["value"] is True, side
    assert results[2]["broken"]["finish"].startswith("the update to weight version 1 failed")
    assert results[2]["bitwise"] is True


@pytest.mark.timeout(90)
def test_failures_reach_every_rank(tmp_path):
    results = run_ranks(failures, 2, tmp_path, timeout_s=80)
    sender, receiver = results[0], results[1]
    assert "uncaught" not in sender and "uncaught" not in receiver, (sender, receiver)
    for side in (sender, receiver):
        for case in ("plan_mismatch", "unknown_name", "receiver_raises", "source_drift"):
            assert side[case]["ok"] is False and side[case]["type"] == "RefitError", (case, side)
            assert side[case]["elapsed_s"] < 10.0, (case, side[case])
        assert side["healthy_again"]["ok"] is True and side["healthy_again"]["value"] is True
    # A failed refit still reads its whole pass (ranks reading a collective source in step are
    # never left inside it), also when the start was refused before the first tensor.
    assert {case: sender[case]["read"] for case in sender} == {
        case: (0 if case == "plan_mismatch" else len(tiny_mixed_specs())) for case in sender}, \
        sender
    for side in (sender, receiver):
        assert side["plan_mismatch"]["message"].startswith(
            "refit plan mismatch: the ranks hold different plans (trainer rank 0: ")
    assert sender["unknown_name"]["message"].startswith(
        "refit 0 failed on inference rank 0: engine.load_weights on buffer 5: ValueError: "
        "unknown weight name 'head.weight'")
    for side in (sender, receiver):
        assert "unknown weight name 'head.weight': the tensor-dict engine on cpu has no " \
               "parameter or buffer of that name" in side["unknown_name"]["message"]
        assert "engine.load_weights on buffer 1" in side["receiver_raises"]["message"]
        assert "RuntimeError: engine exploded on load_weights call 2" in \
               side["receiver_raises"]["message"]
        drift = side["source_drift"]["message"]
        assert drift.startswith("refit 0 failed on trainer rank 0: ")
        assert "the weight source yielded 'layers.0.step' (3,) torch.float64 at position 5, " \
               "the refit plan expects 'layers.0.step' (3,) torch.int64" in drift
    assert receiver["receiver_raises"]["finish"].startswith(
        "the update to weight version 1 failed")
    assert receiver["healthy_again"]["finish"] is None


@pytest.mark.timeout(60)
def test_dead_receiver_is_an_error_on_the_sender(tmp_path):
    results = run_ranks(dead_receiver, 2, tmp_path, timeout_s=50)
    assert results[1] is None  # killed
    sender = results[0]
    assert sender["ok"] is False and sender["type"] in ("RefitError", "RefitTimeout"), sender
    assert re.search(r"Connection (closed|reset) by peer|timed out", sender["message"]), sender
    assert sender["elapsed_s"] < 5.0 + 2.0


@pytest.mark.timeout(60)
def test_absent_receiver_times_out_naming_the_wait(tmp_path):
    results = run_ranks(absent_receiver, 2, tmp_path, timeout_s=50)
    sender = results[0]
    assert sender["ok"] is False and sender["type"] == "RefitTimeout", sender
    assert sender["message"].startswith(
        "timed out after 2 s waiting for the start of refit 0 on every rank on the control "
        "group"), sender["message"]
    assert 2.0 <= sender["elapsed_s"] < 5.0
    assert results[1] == {"slept": True}
