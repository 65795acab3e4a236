"""The refit benchmark recipe on CPU: every mode runs, verifies bit for bit and reports."""

import json

import pytest

from tests.launch import REPO_ROOT, run_torchrun

RECIPE = REPO_ROOT / "recipes" / "refit_bench.py"
CONFIG = REPO_ROOT / "configs" / "refit_bench_cpu.yaml"
MODE_FIELDS = {"mode", "bytes", "refit_s_median", "gbps", "peak_extra_bytes", "verified",
               "device", "phases", "receiver_phases", "num_tensors", "new_allocations"}


def _lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _check(lines: list[dict], *, source: str, placement: str, modes: list[str]) -> dict:
    *per_mode, summary = lines
    assert [line["mode"] for line in per_mode] == modes
    for line in per_mode:
        assert MODE_FIELDS <= set(line), line
        assert line["source"] == source and line["placement"] == placement
        assert line["device"] == "cpu" and line["error"] is None
        assert line["refit_s_median"] > 0 and line["gbps"] > 0
        assert len(line["refit_s"]) == 2
    transport = [line for line in per_mode if line["mode"] in ("naive", "single_buffer",
                                                                "engine", "transport_alone")]
    assert all(line["verified"] is True for line in transport)
    for line in transport:
        if line["mode"] != "naive" or placement == "colocated":
            assert set(line["phases"]) == {"export_s", "pack_s", "transfer_s", "load_s",
                                           "wait_s", "checksum_s"}
            assert line["receiver_phases"]["load_s"] > 0
    assert summary["summary"] is True and summary["all_verified"] is True
    assert set(summary["modes"]) == set(modes)
    assert ("raw_link" in modes) == (summary["raw_link_gbps"] is not None)
    return summary


ALL_MODES = ["raw_link", "naive", "single_buffer", "engine", "export_alone", "transport_alone"]


@pytest.mark.timeout(180)
def test_bench_non_colocated_cpu():
    result = run_torchrun(RECIPE, "--config", str(CONFIG), nproc=2, timeout_s=170)
    summary = _check(_lines(result.stdout), source="tiny", placement="non_colocated",
                     modes=ALL_MODES)
    assert summary["targets"]["transport_vs_link"]["target"] == 0.85


@pytest.mark.timeout(180)
def test_bench_colocated_cpu(tmp_path):
    output = tmp_path / "bench.jsonl"
    result = run_torchrun(RECIPE, "--config", str(CONFIG), "refit.mode=colocated",
                          "bench.modes=[raw_link, naive, engine]", f"bench.output={output}",
                          nproc=1, timeout_s=170)
    lines = _lines(result.stdout)
    _check(lines, source="tiny", placement="colocated", modes=["raw_link", "naive", "engine"])
    assert [json.loads(line) for line in output.read_text().splitlines()] == lines
    naive = lines[1]
    assert naive["num_buffers"] == naive["num_tensors"] == 10  # one tensor per message


@pytest.mark.timeout(300)
def test_bench_from_the_megatron_export_cpu():
    result = run_torchrun(RECIPE, "--config", str(CONFIG), "bench.source=megatron",
                          "bench.modes=[engine, export_alone, transport_alone]",
                          nproc=2, timeout_s=290)
    lines = _lines(result.stdout)
    summary = _check(lines, source="megatron", placement="non_colocated",
                     modes=["engine", "export_alone", "transport_alone"])
    engine = lines[0]
    assert "model.embed_tokens.weight" not in engine  # names are not dumped, counts are
    assert engine["num_tensors"] > 30  # tiny Llama: 4 layers × 9 + embed, norm, head
    target = summary["targets"]["end_to_end_vs_max_export_transport"]
    assert target["target"] == 1.15 and target["export_s"] > 0 and target["transport_s"] > 0


@pytest.mark.timeout(240)
def test_bench_megatron_tp2_trainers_to_two_inference_ranks_cpu():
    """Split job: 2 trainer ranks hold the tiny Llama at TP2 (Megatron sees only them), trainer
    rank 0 sends, trainer rank 1 drains the export in step, 2 inference ranks receive."""
    import torch

    from mcore_refit.refit.synthetic import llama_specs

    result = run_torchrun(RECIPE, "--config", str(CONFIG), "bench.source=megatron",
                          "bench.num_trainer_ranks=2", "megatron.parallel.tensor=2",
                          nproc=4, timeout_s=230)
    lines = _lines(result.stdout)
    summary = _check(lines, source="megatron", placement="non_colocated", modes=ALL_MODES)
    layout = {"trainer_ranks": 2, "inference_ranks": 2, "tp": 2, "pp": 1, "vpp": None, "dp": 1}
    assert all(line["layout"] == layout for line in lines)
    # Full (TP-gathered) HF tensors of the tiny_llama preset, not TP shards.
    expected = llama_specs(num_layers=4, hidden=64, intermediate=128, num_heads=4,
                           num_kv_heads=2, head_dim=16, vocab=128, dtype=torch.float32)
    for line in lines[:-1]:
        if line["mode"] != "raw_link":
            assert line["bytes"] == sum(s.num_bytes for s in expected), line
        if line["mode"] in ("naive", "single_buffer", "engine", "transport_alone"):
            assert line["num_tensors"] == len(expected) == 39, line
    assert summary["all_verified"] is True


def test_bench_rejects_a_bad_override():
    with pytest.raises(AssertionError, match="bench.modes must be distinct entries of"):
        run_torchrun(RECIPE, "--config", str(CONFIG), "bench.modes=[fast]", nproc=1,
                     timeout_s=60)
