"""Policy training parity across layouts against the non-pipelined reference (CPU, gloo).

Three launches: one rank (the PP1 reference), two ranks (PP2×VPP2, PP2, DP2, TP2) and four ranks
(TP2×PP2×VPP2), each running the same three optimizer steps (cross entropy ×2, vanilla policy
gradient) on a tiny 8-layer Llama in fp32 and bf16, and on the same model with tied embeddings
(where PP>1 needs finalize_model_grads to add the embedding and output-layer gradients across
stages).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.policy_results import (
    assert_within,
    hf_logprobs,
    load,
    max_abs_diff,
    parity_figures,
    run_parity,
)

PIPELINED = ("pp2_vpp2", "pp2")
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory):
    from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("policy_parity") / "llama8",
                                 TinyModelSpec(num_layers=8))


@pytest.fixture(scope="module")
def tied_hf_path(tmp_path_factory):
    from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("policy_parity") / "llama8_tied",
                                 TinyModelSpec(num_layers=8, tie_word_embeddings=True))


@pytest.fixture(scope="module")
def runs(hf_path, tied_hf_path, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("policy_parity_runs")
    run_parity(hf_path=hf_path, out_dir=out_dir, nproc=1, layouts=["pp1"], clip_layouts=["pp1"],
               dtypes=list(DTYPES), tied_hf_path=tied_hf_path, tied_layouts=["pp1"])
    run_parity(hf_path=hf_path, out_dir=out_dir, nproc=2, layouts=[*PIPELINED, "dp2", "tp2"],
               clip_layouts=["pp2_vpp2"], dtypes=list(DTYPES), tied_hf_path=tied_hf_path,
               tied_layouts=["pp2_vpp2"], temperature_layouts=["pp2_vpp2", "tp2"])
    return {path.stem: load(path) for path in out_dir.glob("*.pt")}


@pytest.fixture(scope="module")
def runs_x4(hf_path, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("policy_parity_runs_x4")
    run_parity(hf_path=hf_path, out_dir=out_dir, nproc=4, layouts=["tp2_pp2_vpp2"],
               dtypes=list(DTYPES))
    return {path.stem: load(path) for path in out_dir.glob("*.pt")}


# TP2×PP2×VPP2 against PP1 after three Adam steps at lr 1e-3. TP splits the matmul reductions
# and the vocabulary-parallel log-softmax, so the match is up to round-off (measured on CPU:
# fp32 loss 6e-8 rel, grad norm 2e-7 rel, weights 1.9e-5, logprobs 1.4e-6; bf16 loss 7e-5 rel,
# grad norm 9e-4 rel, weights 3.9e-3, logprobs 6.9e-3). Bounds: the TP2 and tied tests' own.
X4_BOUNDS = {
    "float32": {"loss_rel": 1e-6, "grad_norm_rel": 1e-6, "weights_max_abs": 1e-4,
                "logprobs_initial_max_abs": 1e-5, "logprobs_final_max_abs": 1e-5},
    "bfloat16": {"loss_rel": 1e-3, "grad_norm_rel": 5e-3, "weights_max_abs": 1e-2,
                 "logprobs_initial_max_abs": 5e-2, "logprobs_final_max_abs": 5e-2},
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tp2_pp2_vpp2_trains_like_tp1_pp1(runs, runs_x4, dtype):
    run, reference = runs_x4[f"tp2_pp2_vpp2_{dtype}"], runs[f"pp1_{dtype}"]
    assert_within(parity_figures(run, reference), X4_BOUNDS[dtype])
    assert len(run["weights"]) == 75
    assert [s["lr"] for s in run["steps"]] == [s["lr"] for s in reference["steps"]]
    assert [s["num_tokens"] for s in run["steps"]] == [s["num_tokens"] for s in reference["steps"]]
    assert [s["num_micro_batches"] for s in run["steps"]] == [4, 4, 4]
    # The reference model is the initial one, swapped in and out without touching the policy.
    assert torch.equal(run["reference_logprobs_final"], run["logprobs_initial"])
    assert torch.equal(run["logprobs_after_reference"], run["logprobs_final"])
    assert abs(run["steps"][2]["loss"] - run["pg_loss_from_logprobs"]) <= 1e-5


def assert_bitwise_parity(run, reference) -> None:
    """Losses, weights and logprobs bitwise; grad norm up to fp32 round-off."""
    figures = parity_figures(run, reference)
    assert figures["losses_bitwise"], figures
    assert figures["weights_bitwise"], figures
    assert torch.equal(run["logprobs_initial"], reference["logprobs_initial"])
    assert torch.equal(run["logprobs_final"], reference["logprobs_final"])
    # The norm is reduced across stages in another order: equal up to fp32 round-off.
    assert figures["grad_norm_rel"] <= 1e-6, figures


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tp2_pp2_vpp2_equals_tp2_bitwise(runs, runs_x4, dtype):
    """Pipelining adds no round-off on top of TP2: all of the difference to PP1 is TP's."""
    run, reference = runs_x4[f"tp2_pp2_vpp2_{dtype}"], runs[f"tp2_{dtype}"]
    assert_bitwise_parity(run, reference)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", PIPELINED)
def test_pipelined_training_equals_non_pipelined_bitwise(runs, layout, dtype):
    run, reference = runs[f"{layout}_{dtype}"], runs[f"pp1_{dtype}"]
    assert_bitwise_parity(run, reference)
    assert [s["lr"] for s in run["steps"]] == [s["lr"] for s in reference["steps"]]
    assert [s["num_tokens"] for s in run["steps"]] == [s["num_tokens"] for s in reference["steps"]]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_embeddings_train_alike_at_pp2_vpp2(runs, dtype):
    """Tied embeddings: the two gradient halves are added in another order (across stages), so
    the match is up to round-off; a missing cross-stage reduction would be off by percents."""
    run, reference = runs[f"tied_pp2_vpp2_{dtype}"], runs[f"tied_pp1_{dtype}"]
    bounds = {
        "float32": {"loss_rel": 1e-6, "grad_norm_rel": 1e-6, "weights_max_abs": 1e-5,
                    "logprobs_final_max_abs": 1e-5},
        # bf16: PP1 adds the two halves in bf16 before the fp32 main_grad, PP2 in fp32.
        "bfloat16": {"loss_rel": 1e-3, "grad_norm_rel": 5e-3, "weights_max_abs": 1e-2,
                     "logprobs_final_max_abs": 5e-2},
    }
    assert_within(parity_figures(run, reference), bounds[dtype])
    assert len(run["weights"]) == 74  # no lm_head.weight


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", DTYPES)
def test_clipped_training_matches_within_tolerance(runs, dtype):
    run, reference = runs[f"pp2_vpp2_{dtype}_clip"], runs[f"pp1_{dtype}_clip"]
    assert_within(parity_figures(run, reference),
                  {"weights_max_abs": 1e-5 if dtype == "float32" else 1e-2,
                   "loss_rel": 1e-6, "grad_norm_rel": 1e-6})
    # Clipping was active (norms ~3 against a limit of 0.05): the result differs from unclipped.
    assert min(s["grad_norm"] for s in reference["steps"]) > 0.05
    assert max_abs_diff(reference["weights"], runs[f"pp1_{dtype}"]["weights"]) > 1e-5


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_loss_is_normalised_over_the_global_batch(runs, layout):
    """Other splits (DP2: two micro-batches per rank; TP2: vocabulary-parallel log-softmax) give
    the same loss up to round-off."""
    run, reference = runs[f"{layout}_float32"], runs["pp1_float32"]
    assert_within(parity_figures(run, reference),
                  {"loss_rel": 1e-6, "grad_norm_rel": 1e-6, "weights_max_abs": 1e-4,
                   "logprobs_final_max_abs": 1e-5})
    expected_micro_batches = 2 if layout == "dp2" else 4
    assert [s["num_micro_batches"] for s in run["steps"]] == [expected_micro_batches] * 3


@pytest.mark.timeout(600)
def test_training_moved_the_weights(runs, hf_path):
    from mcore_refit.verify import hf_reference_state

    initial = hf_reference_state(str(hf_path))
    assert max_abs_diff(runs["pp1_float32"]["weights"], initial) > 1e-3
    assert len(runs["pp1_float32"]["weights"]) == 75


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run_name", ["pp1_float32", "pp2_vpp2_float32", "pp2_vpp2_bfloat16",
                                      "dp2_float32", "tp2_float32"])
def test_reference_logprobs_are_the_initial_weights(runs, run_name):
    run = runs[run_name]
    assert torch.equal(run["reference_logprobs_final"], run["logprobs_initial"])
    # Swapping the reference in and out left the trained weights as they were.
    assert torch.equal(run["logprobs_after_reference"], run["logprobs_final"])
    assert (run["logprobs_final"] - run["logprobs_initial"]).abs().max() > 1e-3


@pytest.mark.timeout(600)
def test_logprobs_match_hugging_face(runs, hf_path):
    run = runs["pp2_vpp2_float32"]
    expected = hf_logprobs(hf_path, run["eval_tokens"], run["eval_lengths"], temperature=1.0)
    logprobs = run["logprobs_initial"]
    assert logprobs.shape == run["eval_tokens"].shape == (8, 24)
    assert (logprobs - expected).abs().max() <= 1e-5
    positions = torch.arange(24).unsqueeze(0)
    valid = (positions >= 1) & (positions < run["eval_lengths"].unsqueeze(1))
    assert torch.all(logprobs[~valid] == 0)
    assert torch.all(logprobs[valid] < 0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["pp2_vpp2", "tp2"])
def test_temperature_scales_logits_before_the_log_softmax(runs, hf_path, layout):
    """Vocabulary-parallel at TP2: the log-softmax spans both vocabulary shards."""
    run = runs[f"{layout}_float32_temperature"]
    assert run["temperature"] == 0.7
    expected = hf_logprobs(hf_path, run["eval_tokens"], run["eval_lengths"], temperature=0.7)
    assert (run["logprobs"] - expected).abs().max() <= 1e-5
    untempered = runs["pp1_float32"]["logprobs_initial"]
    assert (run["logprobs"] - untempered).abs().max() > 1e-2


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run_name", ["pp1_float32", "pp2_vpp2_float32"])
def test_policy_gradient_loss_uses_advantages_and_mask(runs, run_name):
    """The PG step's loss equals −Σ advantage·logprob / tokens computed outside the pipeline."""
    run = runs[run_name]
    pg_step = run["steps"][2]
    assert abs(pg_step["loss"] - run["pg_loss_from_logprobs"]) <= 1e-5
    assert set(pg_step["metrics"]) == {"advantage"}
    assert set(run["steps"][0]["metrics"]) == {"nll"}
    assert run["steps"][0]["metrics"]["nll"] == pytest.approx(run["steps"][0]["loss"])
