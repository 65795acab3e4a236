"""Export and gradient parity with Hugging Face across layouts (2 and 4 ranks, gloo; the launches
are shared with test_moe_parity, see conftest.py)."""

import re

import pytest

from tests.dist.conftest import EXPORT_PARITY_X4, scenario_report
from tests.launch import REPO_ROOT, last_json_line
from tests.ranks import run_script

RESHAPED = ("decoder.final_layernorm.weight: the parameter was replaced by one of shape (63,) "
            "and dtype torch.float32; the refit plan has (64,) and torch.float32: build a new "
            "plan and refitter for the changed model")

EXPECTED_TENSORS = {
    "llama8_tp2": 75,
    "llama8_pp2": 75,
    "llama8_pp2_vpp2": 75,
    "llama8_pp2_vpp4": 75,
    "llama8_tied_pp2_vpp2": 74,  # no lm_head.weight
    "qwen2_pp2_vpp2": 51,  # 4 layers x 12 (q/k/v biases) + embed, norm, lm_head
    "qwen2_tied_tp2": 50,
    "llama8_pp2_vpp2_bf16": 75,
}
# TP2 × PP2 × VPP2: one 4-rank launch.
EXPECTED_TENSORS_X4 = {
    "llama8_tp2_pp2_vpp2": 75,
    "llama8_tp2_pp2_vpp2_bf16": 75,
}


@pytest.fixture(scope="module")
def results(export_parity_x2):
    return export_parity_x2


@pytest.fixture(scope="module")
def results_x4(export_parity_x4):
    return export_parity_x4


def assert_exact_with_parity(report, scenario):
    """The verifier's report for ``scenario``: bitwise export, loss and grads within tolerance."""
    assert report["tensors"] == {**EXPECTED_TENSORS, **EXPECTED_TENSORS_X4}[scenario]
    assert report["mismatched"] == []
    assert report["missing"] == []
    assert report["unexpected"] == []
    if report["dtype"] == "float32":
        assert report["loss_max_abs_diff"] <= 1e-5
        assert report["grad_max_abs_diff"] <= 1e-5
    else:
        assert report["loss_max_abs_diff"] <= 1e-2
        assert report["grad_max_abs_diff"] <= 1e-2
    assert report["passed"] is True


@pytest.mark.timeout(960)
@pytest.mark.parametrize("scenario", sorted(EXPECTED_TENSORS))
def test_layout_exports_exactly_with_gradient_parity(results, scenario):
    report = scenario_report(results, scenario)
    assert report["device"] == "cpu"
    assert_exact_with_parity(report, scenario)


@pytest.mark.timeout(960)
def test_corrupted_weight_is_named(results):
    assert scenario_report(results, "corrupted") == {
        "mismatched": ["model.norm.weight"], "missing": [], "unexpected": []}


@pytest.mark.timeout(960)
def test_export_reads_current_parameters(results):
    fresh = dict(scenario_report(results, "fresh"))
    reshaped = fresh.pop("reshaped")
    assert fresh == {"in_place": [3.0], "tasks_reused": True, "replaced": [5.0],
                     "tasks_rebuilt": True, "source_in_place": [3.0], "source_replaced": [5.0]}
    # Only the last stage holds the norm; a replacement of another shape is refused there.
    assert reshaped[0] is None
    assert reshaped[1] == RESHAPED


@pytest.mark.timeout(860)
@pytest.mark.parametrize("scenario", sorted(EXPECTED_TENSORS_X4))
def test_tp2_pp2_vpp2_exports_exactly_with_gradient_parity(results_x4, scenario):
    report = scenario_report(results_x4, scenario)
    assert (report["tp"], report["pp"], report["vpp"], report["device"]) == (2, 2, 2, "cpu")
    assert_exact_with_parity(report, scenario)


@pytest.mark.timeout(860)
def test_corrupted_tensor_parallel_shard_is_named(results_x4):
    """One TP rank's shard of a row-parallel weight, perturbed: the gathered tensor differs."""
    assert set(results_x4) == {*EXPORT_PARITY_X4, "corrupted"}
    assert scenario_report(results_x4, "corrupted") == {
        "mismatched": ["model.layers.7.self_attn.o_proj.weight"], "missing": [],
        "unexpected": []}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama",
                                 TinyModelSpec(num_layers=8))


@pytest.mark.timeout(300)
def test_verifier_recipe_prints_json_and_exits_zero(tiny_checkpoint):
    result = run_script(REPO_ROOT / "recipes" / "verify_export.py", "--hf-path",
                        str(tiny_checkpoint), "--pp", "2", "--vpp", "2", nproc=2, timeout_s=300)
    report = last_json_line(result.stdout)
    assert {key: report[key] for key in ("tensors", "mismatched", "missing", "unexpected", "tp",
                                         "pp", "vpp", "device")} == {
        "tensors": 75, "mismatched": [], "missing": [], "unexpected": [], "tp": 1, "pp": 2,
        "vpp": 2, "device": "cpu"}
    assert report["loss_max_abs_diff"] <= 1e-5 and report["grad_max_abs_diff"] <= 1e-5


@pytest.mark.timeout(300)
def test_verifier_recipe_rejects_bad_layout(tiny_checkpoint):
    result = run_script(REPO_ROOT / "recipes" / "verify_export.py", "--hf-path",
                        str(tiny_checkpoint), "--pp", "2", "--vpp", "3", nproc=2, timeout_s=300,
                        expect_failure=True)
    assert re.search(
        r"ValueError: the model's 8 layers do not divide into parallel.pipeline × "
        r"parallel.virtual_pipeline = 2 × 3 = 6 stages; choose sizes whose product divides 8",
        result.stderr), result.stderr[-5000:]
