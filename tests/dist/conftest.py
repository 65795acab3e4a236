"""Launches that several test modules of this folder assert on (session-scoped, one each), and the
start of the fork server that the folder's ranks come from."""

import json
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT
from tests.ranks import run_script, warm_fork_server

_HERE = Path(__file__).resolve().parent
EXPORT_PARITY = REPO_ROOT / "tests" / "dist" / "scenarios" / "export_parity.py"
# scenarios/export_parity.py's layouts on 2 ranks (dense: test_export_parity; Qwen3-MoE:
# test_moe_parity) and on 4.
EXPORT_PARITY_X2 = ["llama8_tp2", "llama8_pp2", "llama8_pp2_vpp2", "llama8_pp2_vpp4",
                    "llama8_tied_pp2_vpp2", "qwen2_pp2_vpp2", "qwen2_tied_tp2",
                    "llama8_pp2_vpp2_bf16", "moe_tp1", "moe_pp2", "moe_pp2_vpp2", "moe_ep2"]
EXPORT_PARITY_X4 = ["llama8_tp2_pp2_vpp2", "llama8_tp2_pp2_vpp2_bf16", "moe_ep2_pp2"]


def pytest_collection_finish(session):
    """Start the fork server of the tests' ranks (tests.ranks) before the first test of this
    folder runs, so that its one-time imports (~15 s of CPU) count against no test's timeout."""
    if not session.config.option.collectonly and any(
            item.path.resolve().is_relative_to(_HERE) for item in session.items):
        warm_fork_server()


def _export_parity(workdir, *args: str, nproc: int, timeout_s: float) -> dict:
    out = workdir / "results.json"
    run_script(EXPORT_PARITY, "--workdir", str(workdir), "--out", str(out), *args, nproc=nproc,
               timeout_s=timeout_s)
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def export_parity_x2(tmp_path_factory):
    """Every 2-rank layout in one launch, with a corrupted weight, a fresh export after the
    parameters change, and Gemma2's error: ``{scenario: report}``."""
    return _export_parity(tmp_path_factory.mktemp("export_parity_x2"), "--only",
                          *EXPORT_PARITY_X2, "--checks", "corrupted", "fresh", "gemma2",
                          nproc=2, timeout_s=900)


@pytest.fixture(scope="session")
def export_parity_x4(tmp_path_factory):
    """Both dtypes at TP2×PP2×VPP2, MoE at EP2×PP2, and a corrupted TP shard, in one 4-rank
    launch."""
    return _export_parity(tmp_path_factory.mktemp("export_parity_x4"), "--only",
                          *EXPORT_PARITY_X4, "--checks", "corrupted", "--corrupt-layout",
                          "llama8_tp2_pp2_vpp2", nproc=4, timeout_s=800)


def scenario_report(results: dict, scenario: str) -> dict:
    """``results[scenario]``, failing with the scenario's traceback where it raised."""
    report = results[scenario]
    assert not (isinstance(report, dict) and "error" in report), \
        f"{scenario} raised:\n{report['error']}"
    return report
