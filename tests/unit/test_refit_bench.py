"""The refit benchmark's configuration, layout checks, mode tables and summary targets."""

import typing

import pytest
import torch

from mcore_refit.bench import colocated, job_fanout, non_colocated
from mcore_refit.bench.config import (
    COLOCATED_MODES,
    BenchConfig,
    MegatronSourceConfig,
    Mode,
    RefitBenchJob,
    TargetsConfig,
    check_layout,
)
from mcore_refit.bench.results import (
    ModeResult,
    colocated_floor_s,
    floor_result,
    fold_rows,
    pool_rounds,
    rank_row,
    summarize,
    transport_result,
)
from mcore_refit.config import ConfigError, ParallelConfig, load_config
from mcore_refit.refit import RefitTelemetry, RefitTimeout
from mcore_refit.refit.config import RefitConfig

TP1 = ParallelConfig()
TP2 = ParallelConfig(tensor=2)


def job(mode="non_colocated", parallel=TP1, **bench) -> RefitBenchJob:
    if bench.get("source") == "megatron":
        bench.setdefault("modes", ["engine"])
    return RefitBenchJob(bench=BenchConfig(**bench), refit=RefitConfig(mode=mode),
                         megatron=MegatronSourceConfig(parallel=parallel))


def test_split_layout_counts_trainer_and_inference_ranks():
    tp2 = check_layout(job(source="megatron", num_trainer_ranks=2, parallel=TP2), world_size=4)
    assert (tp2.placement, tp2.num_trainer_ranks, tp2.num_inference_ranks) == \
        ("non_colocated", 2, 2)
    assert tp2.as_dict() == {"trainer_ranks": 2, "inference_ranks": 2, "tp": 2, "pp": 1,
                             "vpp": None, "dp": 1}
    dp2 = check_layout(job(source="megatron", num_trainer_ranks=4, parallel=TP2), world_size=5)
    assert dp2.as_dict()["dp"] == 2 and dp2.num_inference_ranks == 1
    synthetic = check_layout(job(source="dense_8b"), world_size=3)
    assert synthetic.as_dict() == {"trainer_ranks": 1, "inference_ranks": 2}


def test_colocated_and_trainer_only_layouts_have_no_inference_ranks():
    colocated_tp2 = check_layout(job("colocated", source="megatron", num_trainer_ranks=2,
                                     parallel=TP2), world_size=2)
    assert (colocated_tp2.placement, colocated_tp2.num_inference_ranks) == ("colocated", 0)
    alone = check_layout(job(source="megatron", num_trainer_ranks=2, parallel=TP2,
                             trainer_only=True, modes=["export_alone", "bridge_export_alone"]),
                         world_size=2)
    assert (alone.placement, alone.num_trainer_ranks) == ("trainer_only", 2)


@pytest.mark.parametrize(("kwargs", "world_size", "message"), [
    (dict(source="megatron", num_trainer_ranks=2, parallel=TP2), 2,
     r"^refit.mode=non_colocated needs an inference rank besides the bench.num_trainer_ranks=2 "
     r"trainer ranks: launch more than 2 ranks \(got 2\)$"),
    (dict(source="megatron", num_trainer_ranks=3, parallel=TP2), 4,
     r"^bench.num_trainer_ranks=3 must be a multiple of megatron.parallel tensor × pipeline = "
     r"2 × 1 "),
    (dict(source="megatron", num_trainer_ranks=2,
          parallel=ParallelConfig(tensor=2, pipeline=2, virtual_pipeline=2)), 4,
     r"^bench.num_trainer_ranks=2 must be a multiple of megatron.parallel tensor × pipeline = "
     r"2 × 2 "),
    (dict(source="dense_8b", num_trainer_ranks=2), 3,
     r"^bench.num_trainer_ranks=2 needs bench.source=megatron: a synthetic set \(dense_8b\) "
     r"lives on one trainer rank$"),
    (dict(mode="colocated", source="tiny"), 2,
     r"^a colocated run launches exactly bench.num_trainer_ranks=1 ranks, got 2$"),
])
def test_bad_layouts_are_rejected_by_key(kwargs, world_size, message):
    with pytest.raises(ValueError, match=message):
        check_layout(job(**kwargs), world_size=world_size)


@pytest.mark.parametrize(("overrides", "message"), [
    (["bench.num_trainer_ranks=0"], "bench.num_trainer_ranks must be an integer ≥ 1, got 0"),
    (["bench.rounds=0"], "bench.rounds must be an integer ≥ 1, got 0"),
    (["bench.modes=[engine, engine]"], "bench.modes must be distinct entries of raw_link, "),
    (["bench.modes=[bridge_export]"], "bench.modes ['bridge_export'] measure "
                                      "Megatron-Bridge's export: they need bench.source=megatron"),
    (["bench.source=megatron", "bench.modes=[naive]"],
     "bench.modes naive sends a synthetic set one tensor at a time"),
    (["bench.trainer_only=true"], "bench.trainer_only=true times the export paths alone: "
                                  "bench.modes must be among export_alone, bridge_export_alone"),
    (["bench.targets.link_fraction=0"], "bench.targets.link_fraction must be a positive number"),
    (["megatron.num_layers=0"], "megatron.num_layers must be a positive integer or null"),
    (["refit.buffer_bytes=1"], "refit.buffer_bytes"),
])
def test_bad_bench_configs_name_the_full_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(RefitBenchJob, None, overrides)
    assert message in str(error.value).replace("`", "")


def test_every_mode_has_a_driver_in_its_placements():
    modes = set(typing.get_args(Mode))
    assert set(non_colocated.MODES) == modes - set(COLOCATED_MODES)
    assert set(colocated.MODES) == modes


def test_colocated_only_modes_are_refused_elsewhere():
    with pytest.raises(ConfigError) as error:
        load_config(RefitBenchJob, None, ["bench.modes=[engine,shared_weights]"])
    assert str(error.value) == ("bench.modes shared_weights needs refit.mode=colocated, got "
                                "non_colocated")


def result(mode, seconds, *, payload=1_000_000_000, **fields) -> ModeResult:
    return ModeResult(mode=mode, payload_bytes=payload, refit_s=[seconds], device="cpu",
                      **fields)


def test_summary_checks_the_targets_it_is_given():
    targets = TargetsConfig(link_fraction=0.85, refit_over_transport=1.15,
                            speedup_over_bridge=3.0)
    results = [result("raw_link", 1.0), result("engine", 1.1, verified=True),
               result("transport_alone", 1.0, verified=True),
               result("export_alone", 0.02), result("bridge_export_alone", 0.05)]
    summary = summarize(results, source="dense_8b", placement="non_colocated",
                        targets=targets, alignment_bytes=256)
    checks = summary["targets"]
    assert checks["transport_vs_link"] == {"ratio": 0.9091, "target": 0.85, "met": True}
    assert checks["refit_vs_transport_alone"] == {"ratio": 1.1, "target": 1.15, "met": True,
                                                  "refit_s": 1.1, "transport_s": 1.0}
    assert checks["export_speedup_over_bridge_export"] == {
        "ratio": 2.5, "target": 3.0, "met": False, "export_s": 0.02, "bridge_export_s": 0.05}
    assert summary["raw_link_gbps"] == 1.0 and summary["all_verified"] is True

    stricter = TargetsConfig(link_fraction=0.95, refit_over_transport=1.05)
    checks = summarize(results, source="dense_8b", placement="non_colocated", targets=stricter,
                       alignment_bytes=256)["targets"]
    assert checks["transport_vs_link"]["met"] is False
    assert checks["refit_vs_transport_alone"]["met"] is False


def test_summary_checks_each_fanout_on_its_own():
    results = [result("raw_link", 1.0),
               result("engine/broadcast", 1.3, verified=True, fanout="broadcast"),
               result("transport_alone/broadcast", 1.2, verified=True, fanout="broadcast"),
               result("engine/relay", 1.05, verified=True, fanout="relay"),
               result("transport_alone/relay", 1.0, verified=True, fanout="relay")]
    summary = summarize(results, source="megatron", placement="non_colocated",
                        targets=TargetsConfig(), alignment_bytes=256)
    checks = summary["targets"]
    assert set(checks) == {"refit_vs_transport_alone@broadcast", "refit_vs_transport_alone@relay"}
    assert checks["refit_vs_transport_alone@relay"]["ratio"] == 1.05
    assert checks["refit_vs_transport_alone@broadcast"]["ratio"] == 1.0833
    assert set(summary["modes"]) == {r.mode for r in results}


def test_a_colocated_refit_on_several_gpus_is_checked_against_its_floor():
    # 4 GPUs, 40 GB: rank 3 sends nothing, so it receives all 40 GB over its 400 GB/s ingress
    # (0.1 s); rank 0 receives 30 GB (0.075 s) and copies its 10 GB at 2000 GB/s (0.005 s).
    link = result("raw_link", 0.0005, ingress_gbps=400.0)  # 1 GB copied at 2000 GB/s
    engine = result("engine", 0.11, payload=40_000_000_000, verified=True,
                    source_bytes=[10_000_000_000, 15_000_000_000, 15_000_000_000, 0])
    assert colocated_floor_s(engine, link) == pytest.approx(0.1)
    check = summarize([link, engine], source="megatron", placement="colocated",
                      targets=TargetsConfig(), alignment_bytes=256)["targets"]["refit_vs_floor"]
    assert check == {"ratio": 1.1, "target": 1.15, "met": True, "refit_s": 0.11,
                     "floor_s": 0.1}
    assert colocated_floor_s(engine, result("raw_link", 0.0005)) is None  # one GPU: no ingress


def test_fanouts_are_distinct_and_for_non_colocated_runs():
    assert load_config(RefitBenchJob, None,
                       ["bench.fanouts=[broadcast,relay,direct]"]).bench.fanouts \
        == ["broadcast", "relay", "direct"]
    with pytest.raises(ConfigError, match=r"^bench.fanouts must be distinct entries of "
                                          r"broadcast, relay, direct, or null; "
                                          r"got \['relay', 'relay'\]"):
        load_config(RefitBenchJob, None, ["bench.fanouts=[relay,relay]"])
    with pytest.raises(ConfigError, match="bench.fanouts compares how buffers reach"):
        load_config(RefitBenchJob, None, ["bench.fanouts=[relay]", "refit.mode=colocated"])


def test_the_job_builds_the_links_of_every_fanout_it_runs():
    assert job_fanout(["broadcast"]) == "broadcast"
    assert job_fanout(["direct"]) == "direct"
    assert job_fanout(["broadcast", "direct", "relay"]) == "relay"  # its links include direct's
    assert job_fanout(["relay"]) == "relay"


def test_summary_uses_the_colocated_targets_per_set_and_bounds_peak_memory():
    targets = TargetsConfig(copy_fraction_dense=0.35, copy_fraction_moe=0.25)
    engine = dict(verified=True, held_bytes=2000, largest_tensor_bytes=1000)
    for source, met in (("dense_8b", False), ("moe_30b_a3b", True)):
        results = [result("raw_link", 1.0),
                   result("engine", 3.5, peak_extra_bytes=3512, **engine)]
        checks = summarize(results, source=source, placement="colocated", targets=targets,
                           alignment_bytes=256)["targets"]
        assert checks["transport_vs_link"]["met"] is met
        # held slots + the largest tensor + two alignment units
        assert checks["peak_extra_memory"] == {"bytes": 3512, "bound": 3512, "met": True}
    over = summarize([result("engine", 1.0, peak_extra_bytes=3513, **engine)],
                     source="megatron", placement="colocated", targets=targets,
                     alignment_bytes=256)["targets"]
    assert over["peak_extra_memory"]["met"] is False and "transport_vs_link" not in over


def test_a_failed_verification_fails_the_summary():
    summary = summarize([result("engine", 1.0, verified=False)], source="tiny",
                        placement="non_colocated", targets=TargetsConfig(), alignment_bytes=256)
    assert summary["all_verified"] is False


def name_of(rank: int) -> str:
    return f"trainer rank {rank}" if rank < 2 else f"inference rank {rank - 2}"


def test_the_fold_returns_the_receivers_telemetry():
    row = {"total_s": 0.1, "peak_extra_bytes": 0}
    gathered = [rank_row([], None), rank_row([], None), rank_row([row, row], None)]
    assert fold_rows(gathered, mode="engine", name_of=name_of) == ([row, row], None)


def test_the_fold_names_a_failed_receivers_root_failure_first():
    """A receiver ran out of memory while preparing; the trainer ranks only saw the shared
    failure, or timed out waiting. The fold must not raise, and must lead with the OOM."""
    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    except torch.OutOfMemoryError as error:
        oom = rank_row([], error)
    timeout = rank_row([], RefitTimeout("timed out after 120 s waiting for buffer 3"))
    gathered = [timeout, rank_row([], None), oom]
    telemetry, error = fold_rows(gathered, mode="transport_alone", name_of=name_of)
    assert telemetry == []
    assert error.startswith("mode transport_alone failed on inference rank 0: "
                            "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB\n")
    assert error.index("\nthen: trainer rank 0: RefitTimeout: timed out after 120 s") > 0
    result = transport_result("transport_alone", _Plan(), [], telemetry, verified=False,
                              device="cpu", error=error)
    assert result.error == error and result.refit_s == []


def test_the_receiving_engines_own_figures_are_folded_into_their_medians():
    """vLLM's loader figures (telemetry's ``engine``) reach the bench line as medians; an
    engine without any (the tensor engine) leaves the field empty."""
    def receiver(load_s: float, calls: int, engine: bool = True) -> dict:
        telemetry = RefitTelemetry(role="receiver", transport="colocated", refit_index=0,
                                   device="cpu", num_tensors=1, num_buffers=6, payload_bytes=1)
        if engine:
            telemetry.engine = {"load_s": load_s, "load_calls": calls, "wait_s": load_s / 2}
        return telemetry.as_dict()

    rows = [receiver(0.09, 3), receiver(0.07, 2), receiver(0.08, 2)]
    result = transport_result("engine", _Plan(), [], rows, verified=True, device="cpu",
                              error=None)
    assert result.receiver_engine == {"load_calls": 2, "load_s": 0.08, "wait_s": 0.04}
    assert result.as_dict()["receiver_engine"] == result.receiver_engine
    plain = transport_result("engine", _Plan(), [], [receiver(0, 0, engine=False)],
                             verified=True, device="cpu", error=None)
    assert plain.receiver_engine == {}


def test_the_floor_is_the_slowest_rank_per_repetition_with_its_loaders_median_figures():
    rows = [[[0.10, 0.30], 8, [{"load_cpu_s": 0.09}, {"load_cpu_s": 0.25}]],
            [[0.20, 0.25], 8, [{"load_cpu_s": 0.18}, {"load_cpu_s": 0.20}]]]
    floor = floor_result("vllm_load_floor", rows, device="cpu")
    assert floor.refit_s == [0.20, 0.30] and floor.payload_bytes == 8
    assert floor.receiver_engine == {"load_cpu_s": 0.19}


def test_rounds_pool_each_modes_repetitions_in_the_order_the_modes_first_ran():
    """bench.rounds: a mode's timed repetitions of every round are its figures (the summary's
    ratios are then of medians over all rounds); each round's error keeps its round."""
    ran = [ModeResult(mode="engine", payload_bytes=8, refit_s=[0.10, 0.30], device="cpu",
                      verified=True, held_bytes=4, new_segments=0, phases={"load_s": 0.2},
                      receiver_engine={"load_s": 0.1}),
           result("vllm_load_floor", 0.08),
           ModeResult(mode="engine", payload_bytes=8, refit_s=[0.20, 0.50], device="cpu",
                      verified=None, held_bytes=6, new_segments=1, phases={"load_s": 0.4},
                      receiver_engine={"load_s": 0.3}, error="engine: the engine died"),
           result("vllm_load_floor", 0.12)]
    engine, floor = pool_rounds(ran)
    assert engine.refit_s == [0.10, 0.30, 0.20, 0.50] and engine.refit_s_median == 0.25
    assert floor.mode == "vllm_load_floor" and floor.refit_s == [0.08, 0.12]
    assert (engine.verified, engine.held_bytes, engine.new_segments) == (True, 6, 1)
    assert engine.phases == {"load_s": 0.3} and engine.receiver_engine == {"load_s": 0.2}
    assert engine.error == "round 2 of 2: engine: the engine died"
    assert pool_rounds(ran[:2]) == ran[:2]


def test_rows_out_of_step_are_reported_after_the_root_failure_never_raised():
    # An inference rank still in a refit's outcome exchange while the trainers gather telemetry:
    # its outcome arrives instead of its row.
    outcome = {"ok": True, "value": None, "error": None, "error_type": None, "waited": False}
    failed = rank_row([], RuntimeError("trainer rank 1's export broke"))
    _, error = fold_rows([failed, ["a"], outcome], mode="engine", name_of=name_of)
    assert error.splitlines()[0] == ("mode engine failed on trainer rank 0: RuntimeError: "
                                     "trainer rank 1's export broke")
    assert error.endswith('\nthen: trainer rank 1 sent ["a"] where its telemetry was due: the '
                          'ranks fell out of step\nthen: inference rank 0 sent {"ok": true, '
                          '"value": null, "error": null, "error_type": null, "waited": false} '
                          'where its telemetry was due: the ranks fell out of step')


class _Plan:
    payload_bytes, num_tensors, num_buffers, sources, largest_tensor_bytes = 1, 1, 1, [0], 1
    buffers = ()
