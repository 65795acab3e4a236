"""Offload/onload and checkpoint resume against an uninterrupted run (CPU, gloo, 2 ranks).

Cases: PP2×VPP2 fp32 with Megatron's plain optimizer, and DP2 bf16 with the distributed
optimizer (fp32 master weights sharded over the two ranks).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.dist.policy_results import SCENARIOS, bitwise_equal, load, max_abs_diff, step_values
from tests.ranks import run_script

CASES = ("pp2_vpp2_fp32", "dp2_bf16_distopt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint

    workdir = tmp_path_factory.mktemp("policy_state")
    hf_path = write_tiny_checkpoint(workdir / "llama8", TinyModelSpec(num_layers=8))
    out = workdir / "results.pt"
    run_script(SCENARIOS / "policy_state.py", "--hf-path", str(hf_path), "--workdir",
               str(workdir), "--out", str(out), nproc=2, timeout_s=600)
    return load(out)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_offload_onload_then_training_equals_uninterrupted(results, case):
    """The offload run also swapped the reference weights in and out after step 0."""
    straight, offload = results[case]["straight"], results[case]["offload"]
    assert bitwise_equal(offload["weights"], straight["weights"])
    assert step_values(offload, "loss") == step_values(straight, "loss")
    assert step_values(offload, "grad_norm") == step_values(straight, "grad_norm")
    assert offload["step"] == straight["step"] == 3


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_export_after_onload_gives_the_trained_weights(results, case):
    offload = results[case]["offload"]
    assert bitwise_equal(offload["export_after_onload"], offload["export_before_offload"])
    # The trained weights differ from those exported before offload: not a stale cache.
    assert max_abs_diff(offload["weights"], offload["export_after_onload"]) > 1e-4
    assert offload["same_parameter_objects"] is True


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_offload_releases_parameters_and_gradient_buffers(results, case):
    offload = results[case]["offload"]
    assert offload["empty_params"] == offload["num_params"] > 0
    assert offload["empty_grad_buffers"] == offload["num_grad_buffers"] > 0
    # Parameters, fp32 gradient buffers and Adam moments: several times the parameter bytes.
    assert offload["freed_bytes"] >= 3 * offload["param_bytes"]
    assert offload["refused_while_offloaded"] == (
        "train_step needs the model on the device; call onload() first")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_resumed_run_equals_uninterrupted_bitwise(results, case):
    straight, resumed = results[case]["straight"], results[case]["resumed"]
    assert resumed["step_after_load"] == 2 and resumed["step"] == 3
    assert bitwise_equal(resumed["weights"], straight["weights"])
    assert step_values(resumed, "loss") == step_values(straight, "loss")[2:]
    assert step_values(resumed, "grad_norm") == step_values(straight, "grad_norm")[2:]
    assert step_values(resumed, "lr") == step_values(straight, "lr")[2:]
    assert torch.equal(resumed["logprobs"], straight["logprobs"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_reference_model_survives_checkpoint_load(results, case):
    straight, resumed = results[case]["straight"], results[case]["resumed"]
    assert torch.equal(resumed["reference_logprobs"], resumed["reference_logprobs_before_load"])
    assert torch.equal(resumed["reference_logprobs"], straight["reference_logprobs"])
    assert (resumed["logprobs"] - resumed["reference_logprobs"]).abs().max() > 1e-3


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_a_non_finite_loss_or_gradient_norm_stops_the_step_before_the_update(results, case):
    """The straight run's refused steps changed nothing: the weights right after them, and
    (through the tests above) everything the later steps and the checkpoint depend on."""
    refused = results[case]["straight"]["refused"]
    messages = refused["messages"]
    assert messages["loss"] == "the loss is nan in optimizer step 3; the update was not applied"
    # An infinite gradient becomes NaN where it meets a zero on its way back: either is named.
    assert re.fullmatch(r"the gradient norm is (inf|nan) in optimizer step 3; the update was not "
                        r"applied", messages["grad_norm"] or ""), messages["grad_norm"]
    assert refused["weights_unchanged"] and refused["step_unchanged"]
