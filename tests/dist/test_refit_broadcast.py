"""Non-colocated transport on CPU (gloo, 2-3 real processes): bitwise round trips and failures.

Every scenario runs in freshly spawned processes on a free port; each rank writes a JSON result
that the test asserts on. Failures must reach every rank as a RefitError naming the cause,
within the configured timeout.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from mcore_refit.refit import (
    BroadcastInitInfo,
    RefitConfig,
    RefitError,
    Refitter,
    TensorDictEngine,
    WeightTransferEndpoint,
    build_plan,
    make_sender,
    plan_for_source,
)
from mcore_refit.refit.synthetic import SyntheticWeightSource, TensorListSource, tiny_mixed_specs
from tests.ranks import run_ranks
from tests.tensors import bits

CPU = torch.device("cpu")


def _config(**overrides) -> RefitConfig:
    values = {"buffer_bytes": 2048, "num_buffers": 2, "checksums": True, "timeout_s": 10.0,
              "start_timeout_s": 20.0}
    return RefitConfig(**{**values, **overrides})


def _bump(source) -> None:
    """Change every value, so a later refit must deliver new bytes (stale data would show)."""
    for _, tensor in source.iter_weights():
        tensor.add_(1)


class _CountingSource:
    """``source``, counting the tensors refits read from it."""

    def __init__(self, source) -> None:
        self._source, self.read = source, 0
        self.stable_tensors = getattr(source, "stable_tensors", False)

    def weight_specs(self):
        return self._source.weight_specs()

    def iter_weights(self):
        for item in self._source.iter_weights():
            self.read += 1
            yield item


def _attempt(action) -> dict:
    try:
        return {"ok": True, "value": action()}
    except RefitError as error:
        return {"ok": False, "type": type(error).__name__, "message": str(error)}


# --- scenarios (run inside spawned ranks) -----------------------------------------------------


def round_trip(rank: int, num_buffers_list: list[int]) -> dict:
    """Rank 0 sends the tiny mixed set (non-contiguous) twice per buffer count; others check."""
    specs = tiny_mixed_specs()
    out = {}
    for num_buffers in num_buffers_list:
        config = _config(num_buffers=num_buffers)
        if rank == 0:
            source = SyntheticWeightSource(specs, device=CPU, seed=num_buffers, noncontiguous=True)
            plan = plan_for_source(source, config=config, device=CPU)
            sender = make_sender(config=config, plan=plan, device=CPU, group=None, src_rank=0)
            with Refitter(source=source, sender=sender) as refitter:
                refitter.prepare()
                first = refitter.refit(verify=True).as_dict()
                _bump(source)
                second = refitter.refit(verify=False).as_dict()
            out[num_buffers] = {"telemetry": [first, second],
                                "num_buffers": plan.num_buffers,
                                "oversized": sum(b.oversized for b in plan.buffers)}
            continue
        engine = TensorDictEngine.from_specs(specs, device=CPU)
        checks = []
        with WeightTransferEndpoint(engine=engine, device=CPU, config=config) as endpoint:
            endpoint.init_weight_transfer_engine(BroadcastInitInfo(src_rank=0))
            for version in (1, 2):
                endpoint.start_weight_update()
                telemetry = endpoint.update_weights()
                endpoint.finish_weight_update(version)
                expected = SyntheticWeightSource(specs, device=CPU, seed=num_buffers,
                                                 noncontiguous=True)
                if version == 2:
                    _bump(expected)
                checks.append({
                    "bitwise": all(torch.equal(bits(engine.get_weight(n)), bits(t))
                                   for n, t in expected.iter_weights()),
                    "verified": telemetry.verified, "version": endpoint.weight_version,
                    "refit_index": telemetry.refit_index})
        out[num_buffers] = checks
    return out


def subgroup_round_trip(rank: int) -> dict:
    """Global rank 2 sends to global rank 1 over new_group([1, 2]); rank 0 is not involved."""
    group = dist.new_group([1, 2])
    if rank == 0:
        return {"idle": True}
    specs = tiny_mixed_specs()
    config = _config()
    src_rank = dist.get_group_rank(group, 2)
    if rank == 2:
        source = SyntheticWeightSource(specs, device=CPU, seed=5)
        plan = plan_for_source(source, config=config, device=CPU)
        sender = make_sender(config=config, plan=plan, device=CPU, group=group, src_rank=src_rank)
        with Refitter(source=source, sender=sender) as refitter:
            refitter.prepare()
            return {"src_rank": src_rank, "telemetry": refitter.refit(verify=True).as_dict()}
    engine = TensorDictEngine.from_specs(specs, device=CPU)
    with WeightTransferEndpoint(engine=engine, device=CPU, config=config) as endpoint:
        endpoint.init_weight_transfer_engine(BroadcastInitInfo(src_rank=src_rank, group=group))
        endpoint.start_weight_update()
        telemetry = endpoint.update_weights()
    expected = SyntheticWeightSource(specs, device=CPU, seed=5)
    return {"bitwise": all(torch.equal(bits(engine.get_weight(n)), bits(t))
                           for n, t in expected.iter_weights()),
            "verified": telemetry.verified}


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


def failures(rank: int) -> dict:
    """Plan mismatch, unknown name, receiver raising, sender's source drifting — each a clean
    RefitError on both ranks; then a normal refit proves the group is still healthy."""
    specs = tiny_mixed_specs()
    config = _config()
    source = SyntheticWeightSource(specs, device=CPU, seed=9)
    plan = plan_for_source(source, config=config, device=CPU)
    healthy = TensorDictEngine.from_specs(specs, device=CPU)

    def targets():
        return dict((n, healthy.get_weight(n).clone()) for n in healthy.names)

    cases = {
        "plan_mismatch": {"engine": healthy,
                          "plan": build_plan(specs, buffer_bytes=4096, num_slots=2)},
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
        if rank == 0:
            sender = make_sender(config=config, plan=plan, device=CPU, src_rank=0)
            counted = _CountingSource(case.get("source", source))
            with Refitter(source=counted, sender=sender) as refitter:
                refitter.prepare()
                out[name] = _attempt(lambda: refitter.refit(verify=True).verified)
            out[name]["read"] = counted.read
        else:
            with WeightTransferEndpoint(engine=case["engine"], device=CPU, config=config,
                                        plan=case.get("plan")) as endpoint:
                endpoint.init_weight_transfer_engine(BroadcastInitInfo(src_rank=0))
                endpoint.start_weight_update()
                out[name] = _attempt(lambda: endpoint.update_weights().verified)
                finish = _attempt(lambda: endpoint.finish_weight_update(1))
                out[name]["finish"] = finish.get("message")
        out[name]["elapsed_s"] = time.monotonic() - started
    return out


def _timed_failing_refit(specs, config: RefitConfig) -> dict:
    """Sender side of the receiver-failure scenarios: one refit's outcome and its duration."""
    source = SyntheticWeightSource(specs, device=CPU, seed=2)
    plan = plan_for_source(source, config=config, device=CPU)
    with Refitter(source=source,
                  sender=make_sender(config=config, plan=plan, device=CPU)) as refitter:
        refitter.prepare()
        started = time.monotonic()
        result = _attempt(lambda: refitter.refit().total_s)
        result["elapsed_s"] = time.monotonic() - started
        return result


def dead_receiver(rank: int) -> dict:
    """The receiver's process is SIGKILLed while loading the second buffer."""
    specs = tiny_mixed_specs()
    config = _config(timeout_s=5.0)
    if rank == 0:
        return _timed_failing_refit(specs, config)
    targets = TensorDictEngine.from_specs(specs, device=CPU)
    engine = _ExplodingEngine({n: targets.get_weight(n) for n in targets.names},
                              fail_on_call=2, kill=True)
    with WeightTransferEndpoint(engine=engine, device=CPU, config=config) as endpoint:
        endpoint.init_weight_transfer_engine(BroadcastInitInfo(src_rank=0))
        endpoint.start_weight_update()
        endpoint.update_weights()
    return {"unreachable": True}


def absent_receiver(rank: int) -> dict:
    """The receiver prepares, then never joins the refit: the sender times out."""
    specs = tiny_mixed_specs()
    config = _config(timeout_s=2.0)
    if rank == 0:
        return _timed_failing_refit(specs, config)
    engine = TensorDictEngine.from_specs(specs, device=CPU)
    with WeightTransferEndpoint(engine=engine, device=CPU, config=config) as endpoint:
        endpoint.init_weight_transfer_engine(BroadcastInitInfo(src_rank=0))
        time.sleep(6.0)
    return {"slept": True}


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_round_trip_bitwise_three_ranks(tmp_path):
    results = run_ranks(round_trip, 3, tmp_path, [1, 2, 3], timeout_s=100)
    sender = results[0]
    assert "uncaught" not in sender, sender
    for num_buffers in ("1", "2", "3"):
        report = sender[num_buffers]
        assert report["oversized"] >= 1  # the plan has tensors larger than a buffer
        first, second = report["telemetry"]
        assert first["verified"] is True and first["checksums"] is True
        assert first["bytes"] == sum(s.num_bytes for s in tiny_mixed_specs())
        assert first["num_buffers"] == report["num_buffers"] > 1
        assert (first["refit_index"], second["refit_index"]) == (0, 1)
        for rank in (1, 2):
            checks = results[rank][num_buffers]
            assert [c["bitwise"] for c in checks] == [True, True], (rank, num_buffers)
            assert [c["verified"] for c in checks] == [True, None]
            assert [c["version"] for c in checks] == [1, 2]
            assert [c["refit_index"] for c in checks] == [0, 1]


@pytest.mark.timeout(60)
def test_subgroup_uses_group_ranks(tmp_path):
    results = run_ranks(subgroup_round_trip, 3, tmp_path, timeout_s=50)
    assert results[0] == {"idle": True}
    assert results[2]["src_rank"] == 1 and results[2]["telemetry"]["verified"] is True, results
    assert results[1] == {"bitwise": True, "verified": True}


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
    # A failed refit still reads its whole pass (trainer ranks export in lockstep), also when the
    # start was refused before the first tensor.
    assert {case: sender[case]["read"] for case in sender} == {case: len(tiny_mixed_specs())
                                                               for case in sender}, sender
    for side in (sender, receiver):
        assert side["plan_mismatch"]["message"].startswith(
            "refit plan mismatch: the ranks hold different plans (group rank 0 (sender): ")
    assert "refit 0 failed on group rank 1 (a receiver)" in sender["unknown_name"]["message"]
    for side in (sender, receiver):
        assert "unknown weight name 'head.weight': the tensor-dict engine on cpu has no " \
               "parameter or buffer of that name" in side["unknown_name"]["message"]
        assert "engine.load_weights on buffer 1" in side["receiver_raises"]["message"]
        assert "RuntimeError: engine exploded on load_weights call 2" in \
               side["receiver_raises"]["message"]
        drift = side["source_drift"]["message"]
        assert "refit 0 failed on group rank 0 (the sender)" in drift
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
    assert sender["ok"] is False and sender["type"] == "RefitError", sender
    assert "failed (a peer died or closed the group?)" in sender["message"]
    assert re.search(r"Connection (closed|reset) by peer", sender["message"]), sender["message"]
    assert sender["elapsed_s"] < 5.0 + 2.0


@pytest.mark.timeout(60)
def test_absent_receiver_times_out_naming_the_wait(tmp_path):
    results = run_ranks(absent_receiver, 2, tmp_path, timeout_s=50)
    sender = results[0]
    assert sender["ok"] is False and sender["type"] == "RefitTimeout", sender
    assert sender["message"].startswith(
        "timed out after 2 s waiting for the start of a refit on all 2 ranks of the refit group")
    assert 2.0 <= sender["elapsed_s"] < 5.0
    assert results[1] == {"slept": True}
