"""Runs that survive their users (issue 24, points 1–4), on CPU with the tiny colocated config:
two runs on one directory, non-finite rewards, a crash before the first checkpoint, a damaged
checkpoint, a full disk. Each launch's wall time is printed (the fault table's figures)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint
from tests.dist.test_grpo_resume import rows, saved_tensors
from tests.launch import REPO_ROOT, free_port, last_json_line, run_torchrun
from tests.ranks import run_script

RECIPE = REPO_ROOT / "recipes" / "grpo.py"
CONFIG = REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml"

REWARDS = '''
import math

_calls = 0


def inf_always(problem, completion):
    return math.inf


def nan_from_step_3(problem, completion):
    """digit_match's score for the first two steps' completions (8 prompts x 4 samples), then
    NaN: counts its calls, which every rank makes in the same order."""
    global _calls
    _calls += 1
    if _calls > 2 * 8 * 4:
        return math.nan
    from mcore_refit.grpo.rewards import digit_match
    return digit_match(problem, completion)
'''


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("survival") / "tiny-llama",
                                 TinyModelSpec(num_layers=4))


def recipe_args(checkpoint, out, *overrides):
    return ["--config", str(CONFIG), f"model.hf_path={checkpoint}", f"run.output_dir={out}",
            "run.steps=4", "run.checkpoint_every=2", "run.eval_every=0", "run.plot=false",
            "grpo.prompts_per_step=8", "grpo.samples_per_prompt=4", *overrides]


def launch(args, *, env=None, expect_failure=False, launcher=run_script):
    """Run the recipe on 2 ranks, forked (tests.ranks: what every rank reports is the claim) or
    with ``launcher=run_torchrun``; (result, seconds from the launch until all ranks ended)."""
    started = time.monotonic()
    result = launcher(RECIPE, *args, nproc=2, timeout_s=540, env=env,
                      expect_failure=expect_failure)
    return result, time.monotonic() - started


def test_a_second_run_on_a_directory_is_refused_and_the_first_finishes_intact(checkpoint,
                                                                               tmp_path):
    out = tmp_path / "run"
    lock = out / "run.lock"
    started = time.monotonic()
    first = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(RECIPE),
         *recipe_args(checkpoint, out, "run.steps=10")],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # As soon as the first run holds the directory (before its start-up), start another.
        while not (lock.is_file() and lock.read_text()):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() - started < 300, "the first run took no lock within 300 s"
            time.sleep(0.2)
        holder = json.loads(lock.read_text())["holder"]
        # Under torchrun as the first: both start-ups cost the same, so the second's time says
        # it was refused before its own.
        second, seconds = launch(recipe_args(checkpoint, out, "run.steps=10", "run.seed=99"),
                                 expect_failure=True, launcher=run_torchrun)
        print(f"second run on {out} refused after {seconds:.1f} s (torchrun start to exit)")
        assert (f"run.output_dir '{out}' is in use by another run (pid {holder['pid']} on host "
                f"{socket.gethostname()}, since ") in second.stderr, second.stderr[-5000:]
        while not rows_written(out):  # the first run's start-up and first step
            assert first.poll() is None, first.communicate()
            time.sleep(0.2)
        first_step = time.monotonic() - started
        print(f"the first run logged its first step {first_step:.1f} s after its launch")
        # Refused before a start-up (same machine, same load): the second run built nothing.
        assert seconds < first_step
        stdout, stderr = first.communicate(timeout=540)
    finally:
        with contextlib.suppress(ProcessLookupError):
            first.kill()
    assert first.returncode == 0, stderr[-5000:]
    assert [row["step"] for row in rows(out)] == list(range(1, 11))
    assert json.loads((out / "trainer_state.json").read_text())["step"] == 10
    assert checkpoint_names(out) == ["step_000008", "step_000010"]
    assert "seed: 99" not in (out / "config.yaml").read_text()
    assert lock.read_text() == ""  # released


def rows_written(out):
    return (out / "metrics.jsonl").is_file() and bool((out / "metrics.jsonl").read_text().strip())


def checkpoint_names(out):
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())


def test_non_finite_rewards_a_crash_before_the_first_checkpoint_and_a_damaged_one(
        checkpoint, tmp_path):
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "bad_rewards.py").write_text(REWARDS)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "rewards"), str(REPO_ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "run"

    # 1. An infinite reward in step 1: stopped before any checkpoint, on both ranks.
    failed, seconds = launch(recipe_args(checkpoint, out, "task.reward=bad_rewards:inf_always"),
                             env=env, expect_failure=True)
    print(f"inf reward in step 1: the launch ended {seconds:.1f} s after it began")
    # Each rank's traceback ends with the shared failure.
    assert failed.stderr.count("RankFailure: scoring step 1 failed on trainer rank 0: "
                               "NonFiniteError: step 1: the reward is inf for sample 0 of "
                               "problem 0 of the step (") >= 2, failed.stderr[-5000:]
    assert "from task.reward='bad_rewards:inf_always'; the step stopped before the update" \
        in failed.stderr
    assert not (out / "trainer_state.json").exists()
    assert not list(out.glob("checkpoints/step_*"))

    # 2. The directory holds no checkpoint: a fresh run takes it over. NaN from step 3 on.
    failed, seconds = launch(recipe_args(checkpoint, out,
                                         "task.reward=bad_rewards:nan_from_step_3"),
                             env=env, expect_failure=True)
    print(f"NaN reward in step 3: the launch ended {seconds:.1f} s after it began")
    assert (f"a run that saved no checkpoint was here in run.output_dir '{out}'; starting at "
            "step 0 and replacing ") in failed.stderr
    assert failed.stderr.count("RankFailure: scoring step 3 failed on trainer rank 0: "
                               "NonFiniteError: step 3: the reward is nan for sample 0 of "
                               "problem 0 of the step (") >= 2, failed.stderr[-5000:]
    state = json.loads((out / "trainer_state.json").read_text())
    assert (state["step"], state["checkpoint"]) == (2, "checkpoints/step_000002")
    assert [row["step"] for row in rows(out)] == [1, 2]
    tensors = saved_tensors(out / "checkpoints" / "step_000002")
    assert tensors and all(torch.isfinite(t).all() for t in tensors.values()
                           if t.is_floating_point())

    # 3. The reward fixed: --resume continues from step 2.
    resumed, seconds = launch([*recipe_args(checkpoint, out, "task.reward=digit_match"),
                               "--resume"], env=env)
    print(f"--resume after the NaN: {seconds:.1f} s")
    assert last_json_line(resumed.stdout)["steps"] == 2
    assert [row["step"] for row in rows(out)] == [1, 2, 3, 4]
    assert all(math.isfinite(row["reward_mean"]) for row in rows(out))
    assert checkpoint_names(out) == ["step_000002", "step_000004"]

    # 4. The latest checkpoint's shard cut short: --resume falls back to step 2, naming it.
    shard = out / "checkpoints" / "step_000004" / "__0_0.distcp"
    size = shard.stat().st_size
    with shard.open("r+b") as file:
        file.truncate(size // 2)
    resumed, seconds = launch([*recipe_args(checkpoint, out, "task.reward=digit_match",
                                            "run.steps=6"), "--resume"], env=env)
    print(f"--resume past a truncated shard: {seconds:.1f} s")
    assert (f"--resume: passing over a damaged checkpoint ({shard} is truncated: {size // 2} "
            "bytes, the checkpoint's index needs ") in resumed.stderr
    assert f"resuming from {out / 'checkpoints' / 'step_000002'} (step 2)" in resumed.stderr
    assert last_json_line(resumed.stdout)["steps"] == 4
    assert [row["step"] for row in rows(out)] == [1, 2, 3, 4, 5, 6]
    assert checkpoint_names(out) == ["step_000004", "step_000006"]


def mounted_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                            capture_output=True)
    return result.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_names_the_file_being_written(checkpoint, tmp_path):
    disk = tmp_path / "disk"
    if not mounted_tmpfs(disk, "1m"):
        pytest.skip("this machine does not allow mounting a tmpfs")
    try:
        out = disk / "run"
        failed, seconds = launch(recipe_args(checkpoint, out, "run.checkpoint_every=1",
                                             "run.tensorboard=false"), expect_failure=True)
        named = [line for line in failed.stderr.splitlines() if "no space left" in line]
        print(f"a full disk: the launch ended {seconds:.1f} s after it began; {named[:1]}")
        assert f"no space left on device writing {out}" in failed.stderr, failed.stderr[-5000:]
        assert not (out / "trainer_state.json").exists() or json.loads(
            (out / "trainer_state.json").read_text())["step"] >= 1
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)
