"""The non-colocated transport over two-rank links on CPU (gloo, 3-4 real processes):
``refit.transport.fanout=relay`` (each buffer from its source to one inference rank, which
forwards it to the others) and ``direct`` (from its source to every inference rank at once,
nothing forwarded). Bitwise into 2 and 3 engines from one source and from two (PP2-like)
sources; a failure in the middle of a refit reaches every rank as a RefitError naming the failing
rank, in seconds.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from mcore_refit.bench.synthetic import SyntheticWeightSource, tiny_mixed_specs
from mcore_refit.refit import (
    LocalSource,
    NonColocatedInitInfo,
    Refitter,
    TensorDictEngine,
    WeightTransferEndpoint,
    plan_for_source,
)
from mcore_refit.refit.transports.non_colocated.fanout import entries
from tests.dist.test_refit_broadcast import (
    CPU,
    _attempt,
    _ExplodingEngine,
    _Job,
    _options,
    _plan_config,
    sharded_round_trip,
)
from tests.ranks import run_ranks
from tests.tensors import bits


class _LinkJob(_Job):
    """A hand-built non-colocated job with the links of ``fanout`` (relay or direct): a two-rank
    group per direction. A direct job keeps no data groups and no links between engines, so
    the refit can only use the links from the sources."""

    def __init__(self, rank: int, *, fanout: str, trainers: int, receivers: int) -> None:
        super().__init__(rank, trainers=trainers, receivers=receivers)
        if fanout == "direct":
            self.data_groups = {}
        pairs = {"relay": self.placement.relay_links, "direct": self.placement.direct_links}
        self.links = {}
        for link in pairs[fanout]():
            group = dist.new_group(list(link))  # every rank creates every group, in one order
            if rank in link:
                self.links[link] = group

    def sender(self, plan, options, **kwargs):
        return super().sender(plan, options, links=self.links, **kwargs)

    def endpoint(self, engine, options, plan=None) -> WeightTransferEndpoint:
        endpoint = WeightTransferEndpoint(engine=engine, device=CPU, options=options, plan=plan)
        endpoint.init_weight_transfer_engine(NonColocatedInitInfo(
            placement=self.placement, receiver=self.receiver, control=self.control,
            data_groups={s: g for s, g in self.data_groups.items() if s != self.rank},
            links=self.links))
        return endpoint


# --- scenarios (run inside fresh ranks) -------------------------------------------------------


def link_round_trip(rank: int, fanout: str, trainers: int, receivers: int) -> dict:
    """``trainers`` sources (tensor i on rank i % trainers) send the tiny mixed set to
    ``receivers`` engines twice over ``fanout``'s links (every value changed in between);
    receivers check bitwise."""
    job = _LinkJob(rank, fanout=fanout, trainers=trainers, receivers=receivers)
    report, plan = sharded_round_trip(job, _options(fanout=fanout), seed=5, noncontiguous=True)
    if plan is not None:
        report.update(entries=entries(plan, job.placement),
                      sources=[b.source for b in plan.buffers])
    return report


def link_fails(rank: int, fanout: str) -> dict:
    """One source, three engines over ``fanout``'s links: inference rank 1 (with the relay, the
    entry of some buffers) fails loading its second buffer while the refit goes on; every rank
    raises naming it. The next refit is whole again."""
    job = _LinkJob(rank, fanout=fanout, trainers=1, receivers=3)
    specs = tiny_mixed_specs()
    options = _options(fanout=fanout, timeout_s=20.0)
    source = SyntheticWeightSource(specs, device=CPU, seed=8)
    out = {}
    if job.is_trainer:
        local = LocalSource(source)
        plan = plan_for_source(local, config=_plan_config(), device=CPU)
        out["entries"] = entries(plan, job.placement)
        with Refitter(source=local, sender=job.sender(plan, options)) as refitter:
            refitter.prepare()
            for case in ("broken", "healthy"):
                started = time.monotonic()
                out[case] = _attempt(lambda: refitter.refit(verify=True).verified)
                out[case]["elapsed_s"] = time.monotonic() - started
        return out
    targets = TensorDictEngine.from_specs(specs, device=CPU)
    engine = (_ExplodingEngine({n: targets.get_weight(n) for n in targets.names},
                               fail_on_call=2, kill=False) if job.receiver == 1 else targets)
    with job.endpoint(engine, options) as endpoint:
        for case in ("broken", "healthy"):
            started = time.monotonic()
            endpoint.start_weight_update()
            out[case] = _attempt(lambda: endpoint.update_weights().verified)
            out[case]["finish"] = _attempt(lambda: endpoint.finish_weight_update(1)).get(
                "message")
            out[case]["elapsed_s"] = time.monotonic() - started
    out["bitwise"] = all(torch.equal(bits(engine.get_weight(n)), bits(t))
                         for n, t in source.iter_weights())
    return out


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("fanout", "trainers", "receivers"),
                         [("relay", 1, 2), ("relay", 1, 3), ("relay", 2, 2),
                          ("direct", 1, 3), ("direct", 2, 2)],
                         ids=["relay-1_to_2", "relay-1_to_3", "relay-2_sources_to_2",
                              "direct-1_to_3", "direct-2_sources_to_2"])
def test_every_buffer_reaches_every_engine_bitwise(tmp_path, fanout, trainers, receivers):
    results = run_ranks(link_round_trip, trainers + receivers, tmp_path, fanout, trainers,
                        receivers, timeout_s=130)
    for rank in range(trainers):
        report = results[rank]
        assert "uncaught" not in report, report
        assert [t["refit_index"] for t in report["telemetry"]] == [0, 1]
        assert report["telemetry"][0]["verified"] is True
    if fanout == "relay":
        # Every engine is the entry of some buffers of every source, so each forwards to the
        # others.
        report = results[0]
        for source in range(trainers):
            own = [e for e, s in zip(report["entries"], report["sources"], strict=True)
                   if s == source]
            assert set(own) == set(range(receivers)), (source, own)
    for rank in range(trainers, trainers + receivers):
        checks = results[rank]["checks"]
        assert [c["bitwise"] for c in checks] == [True, True], (rank, results[rank])
        assert [c["verified"] for c in checks] == [True, None]
        assert [c["refit_index"] for c in checks] == [0, 1]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fanout", ["relay", "direct"])
def test_a_failure_mid_refit_is_named_on_every_rank(tmp_path, fanout):
    results = run_ranks(link_fails, 4, tmp_path, fanout, timeout_s=160)
    if fanout == "relay":
        assert 1 in results[0]["entries"]  # the failing engine relays buffers to the others
    for rank in range(4):
        side = results[rank]
        assert "uncaught" not in side, side
        broken = side["broken"]
        assert broken["ok"] is False and broken["type"] == "RefitError", (rank, side)
        assert broken["message"].startswith("refit 0 failed on inference rank 1: "), broken
        assert "engine exploded on load_weights call 2" in broken["message"]
        assert broken["elapsed_s"] < 20.0  # the shared outcome, not a transport timeout
        assert side["healthy"]["ok"] is True and side["healthy"]["value"] is True, (rank, side)
    for rank in (1, 2, 3):  # every engine holds the whole model after the healthy refit
        assert results[rank]["bitwise"] is True
