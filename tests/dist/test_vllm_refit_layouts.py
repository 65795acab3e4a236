"""Refits of a Megatron model into vLLM engines at TP1, PP2 x VPP2, TP2 and (Qwen3-MoE) EP2, in
both placements: every refit verified inside vLLM, and what reached vLLM bitwise equal to
Megatron-Bridge's own export (see scenarios/vllm_refit.py)."""

from __future__ import annotations

import json

import pytest

from tests.launch import REPO_ROOT
from tests.ranks import run_script

SCENARIO = REPO_ROOT / "tests" / "dist" / "scenarios" / "vllm_refit.py"
DENSE = ["tp1", "pp2_vpp2", "tp2"]
MOE = ["moe_ep2"]


def _run(tmp_path, *, nproc: int, placement: str, layouts: list[str], timeout_s: float,
         ipc_dir: str | None = None) -> dict:
    out = tmp_path / "results.json"
    run_script(SCENARIO, "--workdir", str(tmp_path), "--out", str(out), "--placement",
               placement, "--layouts", *layouts, *(["--ipc-dir", ipc_dir] if ipc_dir else []),
               nproc=nproc, timeout_s=timeout_s)
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(layouts)
    return results


def _check(results: dict, *, engine_ranks: list[str]) -> None:
    for layout, ranks in results.items():
        for name in engine_ranks:
            checks = ranks[name]["checks"]
            assert len(checks) == 2, (layout, name)
            for version, check in enumerate(checks):
                assert check["mismatched"] == [] and check["same_names"], (layout, name, check)
                assert check["verified"] is True and check["weight_version"] == version, check
        for ranks_result in ranks.values():
            for refit in ranks_result.get("refits", []):
                assert refit["verified"] is True and refit["sources"] == [0, 1], layout


# A non-colocated inference rank holds one vLLM engine for the launch: one launch per checkpoint.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layouts", [DENSE, MOE], ids=["dense", "moe"])
def test_vllm_refit_non_colocated_layouts(tmp_path, layouts):
    results = _run(tmp_path, nproc=3, placement="non_colocated",
                   layouts=layouts + ["tp2_held"] if layouts == DENSE else layouts,
                   timeout_s=580)
    _check(results, engine_ranks=["rank2"])


@pytest.mark.timeout(900)
def test_vllm_refit_colocated_layouts(tmp_path, ipc_dir):
    # The sockets under a short /tmp path: under tmp_path, pytest's numbered base directory and
    # the launch's pid could push a socket's path past the ~100 characters a Unix socket allows.
    results = _run(tmp_path, nproc=2, placement="colocated", layouts=DENSE + MOE,
                   timeout_s=880, ipc_dir=ipc_dir)
    _check(results, engine_ranks=["rank0", "rank1"])
    for ranks in results.values():
        for name in ("rank0", "rank1"):
            for check in ranks[name]["checks"]:
                assert check["engine_verified"] is True and check["sources"] == [0, 1], check
