"""Refits of a Megatron model at every layout, both placements, bitwise against Megatron-Bridge.

Each trainer rank exports what it holds (no per-tensor pipeline broadcast or TP gather), the
buffers travel from their source ranks, and every engine tensor must equal Megatron-Bridge's own
full export of the same model, bit for bit, in two refits with the weights changed in between.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import REPO_ROOT, run_torchrun

SCENARIO = REPO_ROOT / "tests" / "dist" / "scenarios" / "refit_layouts.py"


def _run(tmp_path, *, nproc: int, placement: str, layouts: list[str], timeout_s: float,
         no_probe: tuple[str, ...] = ()) -> dict:
    out = tmp_path / "results.json"
    run_torchrun(SCENARIO, "--workdir", str(tmp_path), "--out", str(out), "--placement",
                 placement, "--layouts", *layouts, "--no-probe", *no_probe, nproc=nproc,
                 timeout_s=timeout_s)
    return json.loads(out.read_text())


def _kinds(results: dict) -> set[str]:
    return {kind for ranks in results.values() for result in ranks.values()
            for kind in result.get("kinds", {})}


def _check_receiving(results: dict, *, sources: list[int]) -> None:
    for layout, ranks in results.items():
        for name, result in ranks.items():
            for check in result.get("checks", []):
                assert check == {**check, "verified": True, "mismatched": [],
                                 "same_names": True}, (layout, name, check)
                if "sources" in check:
                    assert check["sources"] == sources, (layout, name)
            for refit in result.get("refits", []):
                assert refit["verified"] is True and refit["sources"] == sources, (layout, name)
            if "engine_verified" in result:
                assert result["engine_verified"] == [True, True], (layout, name)


@pytest.mark.timeout(420)
def test_non_colocated_two_trainer_ranks(tmp_path):
    layouts = ["llama8_tp2", "qwen2_tied_tp2", "llama8_pp2", "llama8_tied_pp2_vpp2",
               "qwen2_pp2_vpp2"]
    results = _run(tmp_path, nproc=3, placement="non_colocated", layouts=layouts,
                   timeout_s=400)
    assert sorted(results) == sorted(layouts)
    for ranks in results.values():
        assert set(ranks) == {"rank0", "rank1", "rank2"} and len(ranks["rank2"]["checks"]) == 2
    _check_receiving(results, sources=[0, 1])
    assert _kinds(results) == {"compiled"}  # every standard mapping only moves rows


@pytest.mark.timeout(420)
def test_colocated_two_trainer_ranks(tmp_path):
    layouts = ["llama8_tp2", "qwen2_tied_tp2", "llama8_pp2", "llama8_tied_pp2_vpp2"]
    results = _run(tmp_path, nproc=2, placement="colocated", layouts=layouts, timeout_s=400)
    assert sorted(results) == sorted(layouts)
    _check_receiving(results, sources=[0, 1])
    assert _kinds(results) == {"compiled"}


@pytest.mark.timeout(300)
def test_conversions_that_are_not_row_moves(tmp_path):
    """Without the row probe for QKV (as for a mapping that does arithmetic), QKV tensors take
    Bridge's full export at TP2 (sharded: the other ranks read it in step) and Bridge's
    conversion on their own rank at PP2; still bitwise."""
    results = _run(tmp_path, nproc=3, placement="non_colocated",
                   layouts=["llama8_tp2", "llama8_pp2"], timeout_s=280, no_probe=("QKVMapping",))
    _check_receiving(results, sources=[0, 1])
    tp2 = {k for r in results["llama8_tp2"].values() for k in r.get("kinds", {})}
    pp2 = {k for r in results["llama8_pp2"].values() for k in r.get("kinds", {})}
    assert tp2 == {"compiled", "fallback"} and pp2 == {"compiled", "converted"}


@pytest.mark.timeout(480)
def test_tp2_pp2_vpp2_on_four_trainer_ranks_both_placements(tmp_path):
    colocated = _run(tmp_path / "colocated", nproc=4, placement="colocated",
                     layouts=["llama8_tp2_pp2_vpp2", "qwen2_tied_tp2_pp2_vpp2"], timeout_s=230)
    _check_receiving(colocated, sources=[0, 1, 2, 3])
    split = _run(tmp_path / "split", nproc=5, placement="non_colocated",
                 layouts=["llama8_tp2_pp2_vpp2"], timeout_s=230)
    assert len(split["llama8_tp2_pp2_vpp2"]["rank4"]["checks"]) == 2
    _check_receiving(split, sources=[0, 1, 2, 3])


@pytest.mark.timeout(600)
def test_moe_into_the_hf_engine_both_placements(tmp_path):
    """Qwen3-MoE (8 experts) at EP2 and PP2 refits into the HF model itself: every per-expert
    tensor lands in its rows of transformers' fused expert tensors, bitwise, read back by name;
    each EP rank sends the experts it holds."""
    layouts = ["moe_ep2", "moe_pp2"]
    split = _run(tmp_path / "split", nproc=3, placement="non_colocated", layouts=layouts,
                 timeout_s=290)
    assert sorted(split) == layouts
    for ranks in split.values():
        assert len(ranks["rank2"]["checks"]) == 2
    _check_receiving(split, sources=[0, 1])
    colocated = _run(tmp_path / "colocated", nproc=2, placement="colocated", layouts=layouts,
                     timeout_s=290)
    _check_receiving(colocated, sources=[0, 1])
    assert _kinds(split) == _kinds(colocated) == {"compiled"}
