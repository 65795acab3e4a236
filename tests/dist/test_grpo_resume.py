"""A resumed GRPO run is bit-identical to an uninterrupted one, also after a kill -9 in the
middle of a checkpoint save (colocated and non-colocated, CPU)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint
from tests.launch import (
    LAUNCH_TAG,
    REPO_ROOT,
    free_port,
    last_json_line,
    launch_env,
    launched_processes,
)
from tests.ranks import run_script

RECIPE = REPO_ROOT / "recipes" / "grpo.py"
KILL_IN_SAVE = REPO_ROOT / "tests" / "dist" / "scenarios" / "grpo_kill_in_save.py"
CONFIGS = {"colocated": (REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml", 2),
           "non_colocated": (REPO_ROOT / "configs" / "grpo_tiny_cpu_non_colocated.yaml", 3),
           # The trainer offloaded while the evaluation generates, onloaded for each save.
           "colocated_offload": (REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml", 2)}
OVERRIDES = {"colocated_offload": ["inference.offload_trainer=true"]}
# The uninterrupted run to compare with. Offloading the trainer changes no figure and no saved
# bit (measured), so the colocated run serves the offloaded mode too, and that is asserted.
REFERENCE = {"colocated_offload": "colocated"}
# The fault table's bound on the time from the kill to the exit of every rank.
EXIT_BOUND_S = 15.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("resume") / "tiny-llama",
                                 TinyModelSpec(num_layers=4))


def recipe_args(mode, checkpoint, out):
    config, _ = CONFIGS[mode]
    return ["--config", str(config), f"model.hf_path={checkpoint}", f"run.output_dir={out}",
            "run.steps=4", "run.checkpoint_every=2", "run.eval_every=3",
            "grpo.prompts_per_step=8", "grpo.samples_per_prompt=4", *OVERRIDES.get(mode, [])]


def is_timing(key):
    """Wall-clock figures of a step (generate_s, refit/export_s, ...); everything else in a
    metrics row must match bit for bit."""
    return key.endswith("_s") or key == "refit_gbps"


def rows(out):
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not is_timing(k)} for line in lines]


def saved_tensors(directory):
    """Every tensor of a torch_dist checkpoint (model, optimizer), read on one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = directory.with_suffix(".pt")
    dcp_to_torch_save(str(directory), str(target))
    state = torch.load(target, weights_only=False)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}{key}.", item)
        elif isinstance(value, torch.Tensor):
            flat[prefix[:-1]] = value

    walk("", state)
    return flat


def kill_in_save(mode, checkpoint, out, *, kill_at):
    """Run until rank 0 is killed inside step ``kill_at``'s save; seconds from the kill until
    every process of the launch (torchrun, ranks, engines) is gone. Leftovers are killed."""
    _, nproc = CONFIGS[mode]
    marker = out.parent / f"{out.name}.killed"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(KILL_IN_SAVE),
               "--kill-at", str(kill_at), "--marker", str(marker), "--",
               *recipe_args(mode, checkpoint, out)]
    tag = uuid.uuid4().hex
    env = launch_env({LAUNCH_TAG: tag})
    log = out.parent / f"{out.name}.log"
    with log.open("w") as output:
        launch = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=output,
                                  stderr=subprocess.STDOUT)
        returncode = launch.wait(timeout=540)
    launcher_exited = time.time()
    deadline = time.time() + 60
    while launched_processes(tag) and time.time() < deadline:
        time.sleep(0.2)
    gone = time.time()
    leftovers = []
    for pid in launched_processes(tag):
        with contextlib.suppress(OSError):
            command_line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            leftovers.append(f"{pid}: {command_line.decode(errors='replace')[:200]}")
            os.kill(pid, signal.SIGKILL)
    assert marker.exists(), f"rank 0 was not killed:\n{log.read_text()[-5000:]}"
    assert returncode != 0
    killed = float(marker.read_text())
    print(f"torchrun exited {launcher_exited - killed:.1f} s after the kill")
    return gone - killed, leftovers


@pytest.fixture(scope="module")
def straight_runs(checkpoint, tmp_path_factory):
    """``straight(mode)``: the output folder of an uninterrupted run for ``mode``, launched once
    per reference mode (see ``REFERENCE``). It and the resumed runs go on forked ranks
    (tests.ranks); the kill, whose claim is the launch's exit, under torchrun."""
    done = {}

    def straight(mode):
        reference = REFERENCE.get(mode, mode)
        if reference not in done:
            out = tmp_path_factory.mktemp(f"straight_{reference}") / "run"
            run_script(RECIPE, *recipe_args(reference, checkpoint, out),
                       nproc=CONFIGS[reference][1], timeout_s=540)
            done[reference] = out
        return done[reference]

    return straight


@pytest.mark.timeout(900)
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="bitwise on CPU; on GPUs the embedding backward accumulates with "
                           "atomics")
@pytest.mark.parametrize("mode", list(CONFIGS))
def test_resume_after_a_kill_in_a_checkpoint_save_is_bit_identical(mode, checkpoint,
                                                                   straight_runs, tmp_path):
    _, nproc = CONFIGS[mode]
    straight, broken = straight_runs(mode), tmp_path / "broken"

    exit_s, leftovers = kill_in_save(mode, checkpoint, broken, kill_at=4)
    print(f"{mode}: kill -9 of rank 0 in the step-4 checkpoint save -> every process of the "
          f"launch exited {exit_s:.1f} s later")
    # The partial checkpoint is never the latest; the state still names step 2's, relatively.
    assert (broken / "checkpoints" / "step_000004.partial").is_dir()
    assert not (broken / "checkpoints" / "step_000004").exists()
    state = json.loads((broken / "trainer_state.json").read_text())
    assert (state["step"], state["checkpoint"]) == (2, "checkpoints/step_000002")
    assert [row["step"] for row in rows(broken)] == [1, 2, 3, 4]

    resumed = run_script(RECIPE, *recipe_args(mode, checkpoint, broken), "--resume",
                         nproc=nproc, timeout_s=540)
    summary = last_json_line(resumed.stdout)
    assert (summary["steps"], summary["resumed_from_step"]) == (2, 2)
    assert not (broken / "checkpoints" / "step_000004.partial").exists()
    # Rewards, losses, grad norms, logprob agreement, the greedy evaluation of steps 3 and 4:
    # every row as the uninterrupted run's.
    assert [("eval/reward_mean" in row) for row in rows(straight)] == [False, False, True, True]
    assert rows(broken) == rows(straight)
    expected = saved_tensors(straight / "checkpoints" / "step_000004")
    actual = saved_tensors(broken / "checkpoints" / "step_000004")
    assert expected.keys() == actual.keys() and len(expected) > 0
    different = [name for name in expected if not torch.equal(expected[name], actual[name])]
    assert not different, different
    assert not leftovers, f"processes left running {exit_s:.0f} s after the kill: {leftovers}"
    assert exit_s <= EXIT_BOUND_S
