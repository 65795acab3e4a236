"""A reward function that hangs on one rank (README, "Faults"): the rank names itself, the
function and its input within run.callback_timeout_s, and the whole launch fails. The reward
module lies in the working directory, which is all it takes to import it."""

import re
import textwrap
import time

import pytest

from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint
from tests.launch import REPO_ROOT
from tests.ranks import run_script

RECIPE = REPO_ROOT / "recipes" / "grpo.py"
COLOCATED = REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml"
TIMEOUT_S = 3


@pytest.mark.timeout(600)
def test_a_reward_hanging_on_one_rank_is_named_and_fails_the_run(tmp_path):
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny-llama", TinyModelSpec(num_layers=4))
    hung = tmp_path / "hung"
    (tmp_path / "hanging_reward.py").write_text(textwrap.dedent(f"""
        import os, time

        def score(problem, completion):
            if os.environ["RANK"] == "1":
                open({str(hung)!r}, "w").write(str(time.time()))
                time.sleep(3600)
            return 0.0
    """))
    # On forked ranks (tests.ranks): what each rank reports is the claim.
    launch = run_script(RECIPE, "--config", str(COLOCATED), f"model.hf_path={checkpoint}",
                        f"run.output_dir={tmp_path / 'run'}", "run.steps=3", "eval=null",
                        "run.eval_every=0", "task.reward=hanging_reward:score",
                        f"run.callback_timeout_s={TIMEOUT_S}", nproc=2, timeout_s=540,
                        cwd=tmp_path, expect_failure=True)
    ended = time.time()
    seconds = ended - float(hung.read_text())
    print(f"a reward hanging on rank 1 (run.callback_timeout_s={TIMEOUT_S}): the launch ended "
          f"{seconds:.1f} s after the call began")
    assert re.search(
        # (after rank 0's progress bar, on its line)
        r"CallbackTimeout: trainer rank 1: the reward function "
        r"task.reward='hanging_reward:score' did not return within 3 s "
        r"\(run.callback_timeout_s\), called with \(Problem\(prompt='.*'\); this rank exits$",
        launch.stderr, re.MULTILINE), launch.stderr[-6000:]
    assert re.search(r"PeerDied: trainer rank 1 \(pid \d+ on \S+\) died", launch.stderr), \
        launch.stderr[-6000:]
    assert seconds < 60
    assert "leaked semaphore" not in launch.stderr
