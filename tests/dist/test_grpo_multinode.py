"""GRPO launched as a two-node job on one host: two torchrun agents (``--nnodes 2 --node-rank
0|1``) meeting at one rendezvous endpoint, so every rank's LOCAL_RANK differs from its RANK."""

import json

import pytest

from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint
from tests.launch import REPO_ROOT, last_json_line, run_torchrun_nodes

RECIPE = REPO_ROOT / "recipes" / "grpo.py"
COLOCATED = REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml"
NON_COLOCATED = REPO_ROOT / "configs" / "grpo_tiny_cpu_non_colocated.yaml"
MULT_ERR_BOUND = 1.0001  # as in test_grpo.py: fp32 on CPU agrees to ~2e-7 per token


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("grpo") / "tiny-llama",
                                 TinyModelSpec(num_layers=8))


def steps_logged(output_dir) -> list[int]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


@pytest.mark.timeout(420)
def test_colocated_job_on_two_nodes(checkpoint, tmp_path):
    # One trainer rank per node (PP2 x VPP2 across the nodes), each with its own engine.
    out = tmp_path / "run"
    node0, _ = run_torchrun_nodes(RECIPE, "--config", str(COLOCATED),
                                  f"model.hf_path={checkpoint}", f"run.output_dir={out}",
                                  "run.steps=2", "run.verify_refit=true",
                                  num_nodes=2, nproc_per_node=1, timeout_s=360)
    summary = last_json_line(node0.stdout)
    assert summary["steps"] == 2 and summary["mode"] == "colocated"
    assert 1.0 <= summary["logprob_mult_err_max"] < MULT_ERR_BOUND
    assert steps_logged(out) == [1, 2]


@pytest.mark.timeout(420)
def test_non_colocated_job_with_trainers_and_engines_on_separate_nodes(checkpoint, tmp_path):
    # Node 0: trainer ranks 0, 1 (PP2 x VPP2); node 1: inference ranks 0, 1 (local ranks 0, 1).
    out = tmp_path / "run"
    node0, _ = run_torchrun_nodes(RECIPE, "--config", str(NON_COLOCATED),
                                  f"model.hf_path={checkpoint}", f"run.output_dir={out}",
                                  "run.steps=2", "run.verify_refit=true", "inference.num_ranks=2",
                                  num_nodes=2, nproc_per_node=2, timeout_s=360)
    summary = last_json_line(node0.stdout)
    assert summary["steps"] == 2 and summary["mode"] == "non_colocated"
    assert 1.0 <= summary["logprob_mult_err_max"] < MULT_ERR_BOUND
    assert steps_logged(out) == [1, 2]
