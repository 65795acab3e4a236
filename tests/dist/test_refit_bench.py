"""The refit benchmark recipe on CPU, in every layout: each mode moves the bytes it claims from
the ranks it claims, verifies bit for bit, and the summary's targets follow from the figures."""

import json

import pytest
import torch

from mcore_refit.bench.synthetic import llama_specs, synthetic_specs
from tests.launch import REPO_ROOT
from tests.ranks import run_script

RECIPE = REPO_ROOT / "recipes" / "refit_bench.py"
CONFIG = REPO_ROOT / "configs" / "refit_bench_cpu.yaml"
PHASES = {"export_s", "pack_s", "transfer_s", "load_s", "wait_s", "checksum_s"}
REFIT_MODES = {"naive", "single_buffer", "engine", "transport_alone", "bridge_export"}
TINY_BYTES = sum(s.num_bytes for s in synthetic_specs("tiny"))
# The tiny_llama preset's full Hugging Face tensors (float32).
TINY_LLAMA = llama_specs(num_layers=4, hidden=64, intermediate=128, num_heads=4,
                         num_kv_heads=2, head_dim=16, vocab=128, dtype=torch.float32)
TINY_LLAMA_BYTES = sum(s.num_bytes for s in TINY_LLAMA)


def bench(*overrides: str, nproc: int, timeout_s: float = 170) -> tuple[dict, dict]:
    """Run the recipe (on forked ranks: the figures are the claim, not the launcher); its per-mode
    lines by mode, and its summary line."""
    result = run_script(RECIPE, "--config", str(CONFIG), *overrides, nproc=nproc,
                        timeout_s=timeout_s)
    *lines, summary = [json.loads(line) for line in result.stdout.splitlines()
                       if line.startswith("{")]
    assert summary["summary"] is True
    by_mode = {line["mode"]: line for line in lines}
    assert len(by_mode) == len(lines) and list(summary["modes"]) == list(by_mode)
    for line in lines:
        assert line["error"] is None, line["error"]
        assert len(line["refit_s"]) == 2 and line["refit_s_median"] > 0  # bench.num_refits
        if line["mode"] in REFIT_MODES:
            assert line["verified"] is True, line["mode"]
    assert summary["all_verified"] is True
    return by_mode, summary


def assert_phases(line: dict) -> None:
    assert set(line["phases"]) == PHASES and set(line["receiver_phases"]) == PHASES
    assert line["receiver_phases"]["load_s"] > 0


@pytest.mark.timeout(180)
def test_non_colocated_synthetic_set_every_mode():
    modes, summary = bench(nproc=2)
    assert list(modes) == ["raw_link", "naive", "single_buffer", "engine", "export_alone",
                           "transport_alone"]
    assert modes["raw_link"]["payload_bytes"] == 1 << 20  # bench.raw_link_bytes
    for mode in ("naive", "single_buffer", "engine", "export_alone", "transport_alone"):
        assert modes[mode]["payload_bytes"] == TINY_BYTES and modes[mode]["num_tensors"] == 10
    for mode in ("single_buffer", "engine", "transport_alone"):
        assert_phases(modes[mode])
        assert modes[mode]["num_sources"] == 1
    # One slot (single_buffer) holds less than the configured two; both hold 2048-byte slots.
    assert modes["single_buffer"]["held_bytes"] < modes["engine"]["held_bytes"]
    link = summary["targets"]["transport_vs_link"]
    ratio = modes["engine"]["gbps"] / modes["raw_link"]["gbps"]
    assert link["ratio"] == pytest.approx(ratio, rel=0.01, abs=1e-3)
    assert link["met"] is (link["ratio"] >= link["target"]) and link["target"] == 0.85
    refit = summary["targets"]["refit_vs_transport_alone"]
    assert refit["refit_s"] == modes["engine"]["refit_s_median"]
    assert refit["transport_s"] == modes["transport_alone"]["refit_s_median"]
    assert refit["met"] is (refit["ratio"] <= refit["target"])


@pytest.mark.timeout(180)
def test_colocated_synthetic_set_unpacked_and_packed(tmp_path):
    output = tmp_path / "bench.jsonl"
    result_modes, summary = bench("refit.mode=colocated", "bench.modes=[raw_link, naive, engine]",
                                  f"bench.output={output}", nproc=1)
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line.get("mode") for line in written] == ["raw_link", "naive", "engine", None]
    assert written[-1] == summary
    naive, engine = result_modes["naive"], result_modes["engine"]
    assert naive["num_buffers"] == naive["num_tensors"] == 10  # one tensor per message
    assert engine["num_buffers"] < engine["num_tensors"]  # packed
    for line in (naive, engine):
        assert line["payload_bytes"] == TINY_BYTES
        assert_phases(line)
    assert summary["placement"] == "colocated" and summary["raw_link_gbps"] > 0


@pytest.mark.timeout(300)
def test_megatron_pp2_two_sources_to_one_inference_rank():
    """The 3-rank placement: two pipeline stages send their own tensors."""
    modes, summary = bench("bench.source=megatron", "bench.num_trainer_ranks=2",
                           "megatron.parallel.pipeline=2",
                           "bench.modes=[engine, export_alone, transport_alone, bridge_export, "
                           "bridge_export_alone]", nproc=3, timeout_s=290)
    layout = {"trainer_ranks": 2, "inference_ranks": 1, "tp": 1, "pp": 2, "vpp": None, "dp": 1}
    assert summary["layout"] == layout
    for mode in ("engine", "export_alone", "transport_alone"):
        assert modes[mode]["payload_bytes"] == TINY_LLAMA_BYTES
        assert modes[mode]["num_tensors"] == len(TINY_LLAMA) == 39
        assert modes[mode]["num_sources"] == 2
    # Megatron-Bridge's export gathers every tensor on every rank: rank 0 sends them all.
    assert modes["bridge_export"]["num_sources"] == 1
    assert modes["bridge_export"]["payload_bytes"] == TINY_LLAMA_BYTES
    speedup = summary["targets"]["export_speedup_over_bridge_export"]
    assert speedup["ratio"] == pytest.approx(
        modes["bridge_export_alone"]["refit_s_median"] / modes["export_alone"]["refit_s_median"],
        rel=0.01)
    assert speedup["met"] is (speedup["ratio"] >= 3.0)
    assert summary["targets"]["refit_speedup_over_bridge_export"]["ratio"] > 0


@pytest.mark.timeout(240)
def test_megatron_tp2_trainers_to_two_inference_ranks():
    """2 trainer ranks hold the tiny Llama at TP2 (Megatron sees only them) and each sends the
    pieces of the HF tensors its shards make up to 2 inference ranks."""
    modes, summary = bench("bench.source=megatron", "bench.num_trainer_ranks=2",
                           "megatron.parallel.tensor=2",
                           "bench.modes=[raw_link, single_buffer, engine, transport_alone]",
                           nproc=4, timeout_s=230)
    assert summary["layout"] == {"trainer_ranks": 2, "inference_ranks": 2, "tp": 2, "pp": 1,
                                 "vpp": None, "dp": 1}
    for mode in ("single_buffer", "engine", "transport_alone"):
        # Whole tensors on the receivers, sent as pieces from both ranks.
        assert modes[mode]["payload_bytes"] == TINY_LLAMA_BYTES
        assert modes[mode]["num_sources"] == 2
        assert modes[mode]["num_tensors"] > len(TINY_LLAMA)
        assert_phases(modes[mode])


@pytest.mark.timeout(240)
def test_megatron_tp2_colocated_engines_on_every_rank():
    """Each of 2 TP ranks spawns its own engine; every engine receives the whole model."""
    modes, summary = bench("refit.mode=colocated", "bench.source=megatron",
                           "bench.num_trainer_ranks=2", "megatron.parallel.tensor=2",
                           "bench.modes=[raw_link, engine, bridge_export]", nproc=2,
                           timeout_s=230)
    assert summary["placement"] == "colocated"
    assert modes["engine"]["num_sources"] == 2 and modes["bridge_export"]["num_sources"] == 1
    for mode in ("engine", "bridge_export"):
        assert modes[mode]["payload_bytes"] == TINY_LLAMA_BYTES
        assert_phases(modes[mode])


@pytest.mark.timeout(240)
def test_trainer_only_times_the_exports_with_no_engine():
    modes, summary = bench("bench.source=megatron", "bench.trainer_only=true",
                           "bench.num_trainer_ranks=2", "megatron.parallel.pipeline=2",
                           "bench.modes=[export_alone, bridge_export_alone]", nproc=2,
                           timeout_s=230)
    assert summary["placement"] == "trainer_only" and summary["raw_link_gbps"] is None
    assert summary["layout"]["inference_ranks"] == 0
    assert modes["export_alone"]["num_sources"] == 2
    assert modes["bridge_export_alone"]["num_sources"] == 1
    assert "export_speedup_over_bridge_export" in summary["targets"]


def test_a_bad_override_fails_before_any_rank_starts_work():
    with pytest.raises(AssertionError, match="bench.modes must be distinct entries of raw_link"):
        run_script(RECIPE, "--config", str(CONFIG), "bench.modes=[engine, engine]", nproc=1,
                   timeout_s=60)


@pytest.mark.timeout(300)
def test_megatron_moe_ep2_each_expert_rank_sends_its_experts():
    """The tiny Qwen3-MoE preset at EP2 on 2 trainer ranks -> 1 inference rank: every expert
    leaves from the rank that holds it, verified bit for bit; the output names the preset and
    its depth."""
    modes, summary = bench("bench.source=megatron", "bench.num_trainer_ranks=2",
                           "megatron.preset=tiny_qwen3_moe", "megatron.parallel.expert=2",
                           "bench.modes=[engine, transport_alone, bridge_export]", nproc=3,
                           timeout_s=290)
    assert summary["layout"] == {"trainer_ranks": 2, "inference_ranks": 1, "tp": 1, "pp": 1,
                                 "vpp": None, "dp": 2, "ep": 2}
    assert summary["model"] == {"preset": "tiny_qwen3_moe", "num_layers": 4,
                                "preset_layers": 4, "full_depth": True}
    # 4 layers × (4 attention + 2 qk norms + 2 norms + router + 8 experts × 3) + 3.
    for mode in ("engine", "transport_alone"):
        assert modes[mode]["num_tensors"] == 135
        assert modes[mode]["num_sources"] == 2
    assert modes["bridge_export"]["num_tensors"] == 135
    assert modes["bridge_export"]["num_sources"] == 1


@pytest.mark.timeout(300)
def test_vllm_colocated_refits_from_buffers_and_from_the_trainers_own_memory(tmp_path, ipc_dir):
    """The refit into vLLM (bench.engine=vllm) colocated: from slots, and from the trainer's own
    parameters (shared_weights: Megatron's fused q/k/v arrive as pieces, assembled in a staging
    held for them alone; every other tensor goes to vLLM uncopied), each verified inside vLLM,
    against vLLM's own load of the same tensors."""
    from mcore_refit.tiny import VLLM_SIZES, TinyModelSpec, write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "tiny-llama", TinyModelSpec(**VLLM_SIZES))
    result = run_script(RECIPE, "--config", str(REPO_ROOT / "configs/refit_bench_vllm_cpu.yaml"),
                        f"megatron.hf_path={model}", "refit.mode=colocated",
                        "bench.num_refits=2", "bench.num_warmup=1", "bench.rounds=1",
                        f"refit.transport.ipc_dir={ipc_dir}",
                        "bench.modes=[engine, shared_weights, vllm_load_floor]", nproc=1,
                        timeout_s=280)
    *lines, summary = [json.loads(line) for line in result.stdout.splitlines()
                       if line.startswith("{")]
    modes = {line["mode"]: line for line in lines}
    assert list(modes) == ["engine", "shared_weights", "vllm_load_floor"]
    assert summary["all_verified"] is True
    for mode in ("engine", "shared_weights"):
        assert modes[mode]["error"] is None and modes[mode]["verified"] is True, modes[mode]
        assert modes[mode]["receiver_engine"]["load_calls"] >= 1
        assert modes[mode]["receiver_engine"]["load_cpu_s"] > 0
        assert f"{mode}_vs_vllm_load_floor" in summary["targets"]
    # The floor's loader figures, beside the refits': one call of every tensor.
    assert modes["vllm_load_floor"]["receiver_engine"]["load_calls"] == 1
    assert modes["vllm_load_floor"]["receiver_engine"]["load_cpu_s"] > 0
    # vLLM's loader called with the whole tensors, then with the assembled ones (merged into one
    # call if the first had not started; a median over the refits); staged: only q, k and v.
    assert 1 <= modes["shared_weights"]["receiver_engine"]["load_calls"] <= 2
    q_k_v = (128 + 64 + 64) * 128 * 4  # rows of q, k and v, 128 columns, float32
    assert modes["shared_weights"]["receiver_held_bytes"] == 4 * q_k_v  # 4 layers
    assert modes["engine"]["receiver_held_bytes"] > modes["engine"]["payload_bytes"]
