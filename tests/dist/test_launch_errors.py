"""Recipes launched wrongly fail at once with an error that says what to do."""

import subprocess
import sys
import time

import pytest

from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint
from tests.launch import REPO_ROOT, free_port

COLOCATED = REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml"
NON_COLOCATED = REPO_ROOT / "configs" / "grpo_tiny_cpu_non_colocated.yaml"


def run(*command, timeout_s=300):
    return subprocess.run([sys.executable, *map(str, command)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


def last_line(result):
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.timeout(600)
def test_recipes_without_torchrun_say_how_to_launch(tmp_path):
    result = run(REPO_ROOT / "recipes" / "grpo.py", "--config", COLOCATED,
                 f"run.output_dir={tmp_path}")
    assert result.returncode == 2
    assert last_line(result) == (
        "grpo.py: error: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
        "not set: this recipe runs under torchrun, e.g. `torchrun --standalone --nproc-per-node N "
        "recipes/grpo.py --config configs/X.yaml`")
    result = run(REPO_ROOT / "recipes" / "verify_export.py", "--hf-path", tmp_path)
    assert result.returncode == 2
    assert last_line(result).startswith("verify_export.py: error: RANK, WORLD_SIZE, LOCAL_RANK, "
                                        "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set")


@pytest.mark.timeout(300)
def test_verify_export_refuses_a_sequence_length_of_zero(tmp_path):
    result = run(REPO_ROOT / "recipes" / "verify_export.py", "--hf-path", tmp_path,
                 "--seq-length", "0")
    assert result.returncode == 2
    assert last_line(result) == ("verify_export.py: error: argument --seq-length: must be a "
                                 "positive integer, got 0")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("config", "nproc", "overrides", "message"), [
    (NON_COLOCATED, 2, [],
     "ConfigError: 2 launched ranks less inference.num_ranks=1 leave 1 trainer rank(s), which "
     "do not divide into parallel.tensor × parallel.pipeline = 1 × 2; launch 3 ranks (2 trainer "
     "+ 1 inference)"),
    (COLOCATED, 2, ["grpo.prompts_per_step=1"],
     "ConfigError: grpo.prompts_per_step=1 is smaller than the 2 inference engines (one per "
     "launched rank, refit.mode=colocated); every engine needs at least one prompt per step"),
])
def test_a_launch_that_does_not_fit_fails_before_the_start_up(tmp_path, config, nproc,
                                                              overrides, message):
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny", TinyModelSpec(num_layers=4))
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
         "--master-addr=127.0.0.1", f"--master-port={free_port()}",
         str(REPO_ROOT / "recipes" / "grpo.py"), "--config", str(config),
         f"model.hf_path={checkpoint}", f"run.output_dir={tmp_path / 'run'}", *overrides],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    print(f"refused after {time.perf_counter() - started:.1f} s")
    assert result.returncode != 0
    assert f"{message}\n" in result.stderr, result.stderr[-3000:]
    # Nothing was started: no process group, no model, no log of a run.
    assert not (tmp_path / "run" / "logs").exists()
