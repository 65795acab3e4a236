"""bench.engine=vllm: which sources and modes it takes, and its target in the summary."""

import pytest

from mcore_refit.bench.config import BenchConfig, TargetsConfig
from mcore_refit.bench.results import ModeResult, summarize
from mcore_refit.config import ConfigError


def test_vllm_engine_needs_the_megatron_source_and_a_refit_before_the_floor():
    with pytest.raises(ConfigError, match="engine=vllm needs source=megatron"):
        BenchConfig(engine="vllm", source="dense_8b", modes=["engine"])
    with pytest.raises(ConfigError, match=r"modes \['naive'\] do not run with engine=vllm"):
        BenchConfig(engine="vllm", source="megatron", modes=["naive"])
    with pytest.raises(ConfigError, match="list a refit mode .* before it"):
        BenchConfig(engine="vllm", source="megatron", modes=["vllm_load_floor", "engine"])
    with pytest.raises(ConfigError, match="vllm_load_floor needs engine=vllm"):
        BenchConfig(source="megatron", modes=["engine", "vllm_load_floor"])
    with pytest.raises(ConfigError, match="engine must be one of tensors, vllm"):
        BenchConfig(engine="sglang", source="megatron", modes=["engine"])
    BenchConfig(engine="vllm", source="megatron",
                modes=["engine", "transport_alone", "vllm_load_floor"])


def test_vllm_summary_checks_the_refit_against_vllms_own_load():
    def row(mode, seconds):
        return ModeResult(mode=mode, payload_bytes=1000, refit_s=[seconds], device="cpu",
                          verified=True)

    summary = summarize([row("engine", 1.1), row("transport_alone", 1.3),
                         row("shared_weights", 1.15), row("vllm_load_floor", 1.0)],
                        source="megatron", placement="colocated", targets=TargetsConfig(),
                        alignment_bytes=256)
    assert summary["targets"]["engine_vs_vllm_load_floor"] == {
        "ratio": 1.1, "target": 1.2, "met": True, "refit_s": 1.1, "floor_s": 1.0}
    assert summary["targets"]["transport_alone_vs_vllm_load_floor"]["met"] is False
    assert summary["targets"]["shared_weights_vs_vllm_load_floor"] == {
        "ratio": 1.15, "target": 1.2, "met": True, "refit_s": 1.15, "floor_s": 1.0}
