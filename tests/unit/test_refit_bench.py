"""The refit benchmark's layout checks and its lockstep between sender and draining ranks."""

import pytest

from mcore_refit.config import ParallelConfig
from mcore_refit.refit.bench import (
    BenchConfig,
    check_layout,
    drain_refits,
    num_refits_per_mode,
    run_sender_refits,
)
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transport import RefitError

TP1 = ParallelConfig()
TP2 = ParallelConfig(tensor=2)


def layout(placement="non_colocated", world_size=4, parallel=TP1, **bench):
    return check_layout(placement=placement, world_size=world_size, bench=BenchConfig(**bench),
                        parallel=parallel)


def test_split_layout_counts_trainer_and_inference_ranks():
    split = layout(world_size=4, source="megatron", num_trainer_ranks=2, parallel=TP2)
    assert (split.num_trainer_ranks, split.num_inference_ranks) == (2, 2)
    assert split.as_dict() == {"trainer_ranks": 2, "inference_ranks": 2, "tp": 2, "pp": 1,
                               "vpp": None, "dp": 1}
    dp2 = layout(world_size=5, source="megatron", num_trainer_ranks=4, parallel=TP2)
    assert dp2.as_dict()["dp"] == 2 and dp2.num_inference_ranks == 1
    synthetic = layout(world_size=3, source="dense_8b")
    assert synthetic.as_dict() == {"trainer_ranks": 1, "inference_ranks": 2}


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(world_size=2, source="megatron", num_trainer_ranks=2, parallel=TP2),
     r"needs an inference rank besides the bench.num_trainer_ranks=2 trainer ranks: launch "
     r"more than 2 ranks \(got 2\)"),
    (dict(world_size=4, source="megatron", num_trainer_ranks=3, parallel=TP2),
     r"bench.num_trainer_ranks=3 must be a multiple of megatron.parallel tensor × pipeline = "
     r"2 × 1"),
    (dict(world_size=4, source="megatron", num_trainer_ranks=2,
          parallel=ParallelConfig(tensor=2, pipeline=2, virtual_pipeline=2)),
     r"bench.num_trainer_ranks=2 must be a multiple of megatron.parallel tensor × pipeline = "
     r"2 × 2"),
    (dict(world_size=3, source="dense_8b", num_trainer_ranks=2),
     r"bench.num_trainer_ranks=2 needs bench.source=megatron: a synthetic set \(dense_8b\)"),
    (dict(placement="colocated", world_size=2, source="tiny"),
     r"refit.mode=colocated runs one rank .* got 2 ranks"),
    (dict(placement="colocated", world_size=1, source="megatron", parallel=TP2),
     r"megatron.parallel must be tensor=1, pipeline=1, got tensor=2, pipeline=1"),
])
def test_bad_layouts_are_rejected_by_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        layout(**kwargs)


def test_num_trainer_ranks_must_be_positive():
    with pytest.raises(ValueError, match="bench.num_trainer_ranks must be an integer ≥ 1"):
        BenchConfig(num_trainer_ranks=0)


class RecordingLockstep:
    """Stands in for TrainerLockstep: records the sender's outcomes, replays them to drains."""

    def __init__(self, outcomes=()):
        self.sent: list[tuple[int, bool]] = []
        self._outcomes = list(outcomes)

    def after_refit(self, *, failed: bool, refit_index: int) -> bool:
        self.sent.append((refit_index, failed))
        return self._outcomes[refit_index] if self._outcomes else failed


def telemetry(index: int, *, verified: bool | None = None) -> RefitTelemetry:
    return RefitTelemetry(role="sender", transport="fake", refit_index=index, device="cpu",
                          num_tensors=1, num_buffers=1, bytes=4, total_s=0.1 * (index + 1),
                          verified=verified)


def test_sender_shares_every_outcome_and_stops_at_a_failed_refit():
    bench = BenchConfig(num_warmup=1, num_refits=3, verify=True)
    calls = []

    def refit_once(verify: bool) -> RefitTelemetry:
        calls.append(verify)
        if len(calls) == 3:
            raise RefitError("receiver 2 died")
        return telemetry(len(calls) - 1)

    lockstep = RecordingLockstep()
    timed, verified, error = run_sender_refits(refit_once, bench=bench, lockstep=lockstep)
    assert calls == [False, False, False]
    assert lockstep.sent == [(0, False), (1, False), (2, True)]
    assert [t.refit_index for t in timed] == [1]
    assert verified is False and "receiver 2 died" in error


def test_sender_verifies_on_the_last_refit_only():
    bench = BenchConfig(num_warmup=1, num_refits=2, verify=True)
    calls = []

    def refit_once(verify: bool) -> RefitTelemetry:
        calls.append(verify)
        return telemetry(len(calls) - 1, verified=True if verify else None)

    lockstep = RecordingLockstep()
    timed, verified, error = run_sender_refits(refit_once, bench=bench, lockstep=lockstep)
    assert calls == [False, False, False, True] and num_refits_per_mode(bench) == 4
    assert [t.refit_index for t in timed] == [1, 2]
    assert verified is True and error is None
    assert lockstep.sent == [(i, False) for i in range(4)]


def test_drains_stop_with_the_sender():
    bench = BenchConfig(num_warmup=1, num_refits=3, verify=True)
    passes = []
    drain_refits(lambda: passes.append(1), bench=bench,
                 lockstep=RecordingLockstep([False, False, True, False, False]))
    assert len(passes) == 3
    passes.clear()
    drain_refits(lambda: passes.append(1), bench=bench, lockstep=RecordingLockstep())
    assert len(passes) == num_refits_per_mode(bench) == 5
