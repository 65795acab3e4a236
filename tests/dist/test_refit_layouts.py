"""Refits of a Megatron model at every layout, both placements, bitwise against Megatron-Bridge.

Each trainer rank exports what it holds (no per-tensor pipeline broadcast or TP gather), the
buffers travel from their source ranks, and every engine tensor must equal Megatron-Bridge's own
full export of the same model, bit for bit, in two refits with the weights changed in between.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import REPO_ROOT
from tests.ranks import run_script

SCENARIO = REPO_ROOT / "tests" / "dist" / "scenarios" / "refit_layouts.py"
# The QKV row probe refused (a case of the scenario: LAYOUT~MAPPING).
NO_QKV_PROBE = "~QKVMapping"

# Four launches serve the module, one per world size and placement; each runs its cases in
# sequence in the same ranks (start-up once) and every test asserts on its own cases.
NON_COLOCATED_X2 = ["llama8_tp2", "qwen2_tied_tp2", "llama8_pp2", "llama8_tied_pp2_vpp2",
                    "qwen2_pp2_vpp2"]
COLOCATED_X2 = ["llama8_tp2", "qwen2_tied_tp2", "llama8_pp2", "llama8_tied_pp2_vpp2"]
NOT_ROW_MOVES = ["llama8_tp2" + NO_QKV_PROBE, "llama8_pp2" + NO_QKV_PROBE]
MOE = ["moe_ep2", "moe_pp2"]
TP2_PP2_VPP2 = ["llama8_tp2_pp2_vpp2", "qwen2_tied_tp2_pp2_vpp2"]


def _launch(workdir, *, nproc: int, placement: str, cases: list[str], timeout_s: float) -> dict:
    out = workdir / "results.json"
    run_script(SCENARIO, "--workdir", str(workdir), "--out", str(out), "--placement",
                 placement, "--cases", *cases, nproc=nproc, timeout_s=timeout_s)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def non_colocated_x2(tmp_path_factory):
    """2 trainer ranks and an inference rank: the standard layouts, the conversions that are not
    row moves, and MoE."""
    return _launch(tmp_path_factory.mktemp("non_colocated_x2"), nproc=3,
                   placement="non_colocated", cases=NON_COLOCATED_X2 + NOT_ROW_MOVES + MOE,
                   timeout_s=840)


@pytest.fixture(scope="module")
def colocated_x2(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("colocated_x2"), nproc=2, placement="colocated",
                   cases=COLOCATED_X2 + MOE, timeout_s=600)


def _cases(results: dict, cases: list[str]) -> dict:
    """The launch's results of ``cases``, each present, none raised on any rank (else the
    rank's traceback)."""
    assert set(cases) <= set(results), (sorted(cases), sorted(results))
    for case in cases:
        for name, result in results[case].items():
            assert "error" not in result, f"{case} raised on {name}:\n{result['error']}"
    return {case: results[case] for case in cases}


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


@pytest.mark.timeout(900)
def test_non_colocated_two_trainer_ranks(non_colocated_x2):
    results = _cases(non_colocated_x2, NON_COLOCATED_X2)
    for ranks in results.values():
        assert set(ranks) == {"rank0", "rank1", "rank2"} and len(ranks["rank2"]["checks"]) == 2
    _check_receiving(results, sources=[0, 1])
    assert _kinds(results) == {"compiled"}  # every standard mapping only moves rows


@pytest.mark.timeout(900)
def test_colocated_two_trainer_ranks(colocated_x2):
    results = _cases(colocated_x2, COLOCATED_X2)
    _check_receiving(results, sources=[0, 1])
    assert _kinds(results) == {"compiled"}


@pytest.mark.timeout(900)
def test_conversions_that_are_not_row_moves(non_colocated_x2):
    """Without the row probe for QKV (as for a mapping that does arithmetic), QKV tensors take
    Bridge's full export at TP2 (sharded: the other ranks read it in step) and Bridge's
    conversion on their own rank at PP2; still bitwise."""
    results = _cases(non_colocated_x2, NOT_ROW_MOVES)
    _check_receiving(results, sources=[0, 1])
    tp2 = {k for r in results["llama8_tp2" + NO_QKV_PROBE].values() for k in r.get("kinds", {})}
    pp2 = {k for r in results["llama8_pp2" + NO_QKV_PROBE].values() for k in r.get("kinds", {})}
    assert tp2 == {"compiled", "fallback"} and pp2 == {"compiled", "converted"}


@pytest.mark.timeout(480)
def test_tp2_pp2_vpp2_on_four_trainer_ranks_both_placements(tmp_path):
    colocated = _cases(_launch(tmp_path / "colocated", nproc=4, placement="colocated",
                               cases=TP2_PP2_VPP2, timeout_s=230), TP2_PP2_VPP2)
    _check_receiving(colocated, sources=[0, 1, 2, 3])
    split = _cases(_launch(tmp_path / "split", nproc=5, placement="non_colocated",
                           cases=TP2_PP2_VPP2[:1], timeout_s=230), TP2_PP2_VPP2[:1])
    assert len(split["llama8_tp2_pp2_vpp2"]["rank4"]["checks"]) == 2
    _check_receiving(split, sources=[0, 1, 2, 3])


@pytest.mark.timeout(900)
def test_moe_into_the_hf_engine_both_placements(non_colocated_x2, colocated_x2):
    """Qwen3-MoE (8 experts) at EP2 and PP2 refits into the HF model itself: every per-expert
    tensor lands in its rows of transformers' fused expert tensors, bitwise, read back by name;
    each EP rank sends the experts it holds."""
    split = _cases(non_colocated_x2, MOE)
    for ranks in split.values():
        assert len(ranks["rank2"]["checks"]) == 2
    _check_receiving(split, sources=[0, 1])
    colocated = _cases(colocated_x2, MOE)
    _check_receiving(colocated, sources=[0, 1])
    assert _kinds(split) == _kinds(colocated) == {"compiled"}
