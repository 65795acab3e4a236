"""The GRPO recipe with vLLM as the inference engine (``inference.engine=vllm``) on CPU: it
learns the demo task, vLLM's logprobs agree with the trainer's, and every refit into vLLM is
verified bitwise — colocated (an engine process per trainer rank) and on a dedicated inference
rank."""

import json

import pytest

from mcore_refit.tiny import VLLM_SIZES, TinyModelSpec, write_tiny_checkpoint
from tests.launch import REPO_ROOT, last_json_line, run_torchrun
from tests.ranks import run_script

RECIPE = REPO_ROOT / "recipes" / "grpo.py"
COLOCATED = REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml"
NON_COLOCATED = REPO_ROOT / "configs" / "grpo_tiny_cpu_non_colocated.yaml"
# fp32 on CPU: vLLM and the trainer agree to ~4e-6 per token (measured); a stale or wrong tensor
# is far off.
MULT_ERR_BOUND = 1.0001


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("grpo_vllm") / "tiny-llama",
                                 TinyModelSpec(num_layers=8, **VLLM_SIZES))


def metrics(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def mean(values):
    return sum(values) / len(values)


def grpo_args(config, model, out, *overrides):
    """The recipe's arguments with ``inference.engine=vllm`` on ``model``, writing to ``out``."""
    return ("--config", str(config), "inference.engine=vllm", f"model.hf_path={model}",
            f"run.output_dir={out}", *overrides)


def run_grpo(config, model, out, *overrides, nproc, timeout_s=840):
    """The recipe on forked ranks (tests.ranks): a run's learning and parity are the claim."""
    return run_script(RECIPE, *grpo_args(config, model, out, *overrides), nproc=nproc,
                      timeout_s=timeout_s)


@pytest.mark.timeout(900)
def test_grpo_with_vllm_colocated_learns_and_matches_the_trainer(checkpoint, tmp_path):
    out = tmp_path / "run"
    result = run_grpo(COLOCATED, checkpoint, out, "run.steps=40", "run.eval_every=0",
                      "run.verify_refit=true", nproc=2)
    summary = last_json_line(result.stdout)
    assert summary["steps"] == 40 and summary["mode"] == "colocated"
    assert 1.0 <= summary["logprob_mult_err_max"] < MULT_ERR_BOUND
    rewards = [record["reward_mean"] for record in metrics(out)]
    assert len(rewards) == 40
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.3, rewards


@pytest.mark.timeout(600)
def test_grpo_with_vllm_reads_the_trainers_own_parameters_in_place(checkpoint, tmp_path):
    """``refit.transport.ipc_sharing=weights`` on CPU: the policy's parameters move into shared
    memory and vLLM loads every refit from them (the trainer holds no slots), after each
    optimizer step; every refit verified inside vLLM, vLLM's logprobs agree with the trainer's."""
    out = tmp_path / "run"
    result = run_grpo(COLOCATED, checkpoint, out, "run.steps=3", "run.eval_every=0",
                      "run.verify_refit=true", "parallel.pipeline=1",
                      "parallel.virtual_pipeline=null", "refit.transport.ipc_sharing=weights",
                      nproc=1)
    summary = last_json_line(result.stdout)
    assert summary["steps"] == 3 and summary["mode"] == "colocated"
    assert 1.0 <= summary["logprob_mult_err_max"] < MULT_ERR_BOUND
    records = metrics(out)
    assert [r["refit/held_bytes"] for r in records] == [0, 0, 0]
    assert all(r["refit/verify_s"] > 0 for r in records)


@pytest.mark.timeout(900)
def test_grpo_with_vllm_on_an_inference_rank_refits_by_broadcast(checkpoint, tmp_path):
    out = tmp_path / "run"
    result = run_grpo(NON_COLOCATED, checkpoint, out, "run.steps=15", "run.eval_every=0",
                      "run.verify_refit=true", nproc=3)
    summary = last_json_line(result.stdout)
    assert summary["steps"] == 15 and summary["mode"] == "non_colocated"
    assert 1.0 <= summary["logprob_mult_err_max"] < MULT_ERR_BOUND
    rewards = [record["reward_mean"] for record in metrics(out)]
    assert len(rewards) == 15
    assert mean(rewards[-5:]) > mean(rewards[:5])


@pytest.mark.timeout(600)
def test_a_vllm_engine_that_fails_to_start_on_an_inference_rank_is_named_on_every_trainer_rank(
        tmp_path):
    # Head size 16: vLLM's CPU attention refuses it at the start-up forward.
    narrow = write_tiny_checkpoint(tmp_path / "narrow", TinyModelSpec(num_layers=4))
    # Under torchrun: the failure reaching every trainer rank as the launcher stops them.
    result = run_torchrun(RECIPE, *grpo_args(NON_COLOCATED, narrow, tmp_path / "run",
                                             "run.steps=2"),
                          nproc=3, timeout_s=540, standalone=True, expect_failure=True)
    named = ("RankFailure: start of the inference engines failed on trainer rank 0: RuntimeError: "
             "inference rank 0 failed the engine's start: VllmStartError: vLLM's start-up forward "
             f"failed on model.hf_path='{narrow}' (LlamaForCausalLM, 4 layers, hidden size 64, 4 "
             "heads of head size 16, 2 KV heads): RuntimeError: Unsupported CPU attention "
             "configuration: head_dim=16")
    assert result.stderr.count(named) == 2, result.stderr[-8000:]  # trainer ranks 0 and 1
