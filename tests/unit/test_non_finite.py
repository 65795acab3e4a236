"""The non-finite guard (issue 24, point 2): a NaN or infinite reward or advantage stops the
step naming it; a finished run's plot never fails on such values."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from mcore_refit.config import load_config
from mcore_refit.grpo import loop
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.grpo.console import Console
from mcore_refit.grpo.plot import plot_metrics
from mcore_refit.grpo.tasks import Problem
from mcore_refit.inference.engine import Completion
from mcore_refit.numerics import NonFiniteError, first_non_finite
from tests.launch import REPO_ROOT

CONFIG = REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml"


def job_config(tmp_path, *overrides) -> GRPOJobConfig:
    return load_config(GRPOJobConfig, CONFIG, [f"run.output_dir={tmp_path}",
                                               "grpo.samples_per_prompt=2", *overrides])


def completion(text: str) -> Completion:
    return Completion(prompt_ids=(1,), token_ids=(2, 3), logprobs=(-0.1, -0.2), text=text,
                      stopped=True)


PROBLEMS = [Problem(prompt="5+6=", answer="11"), Problem(prompt="7+8=", answer="15")]


def score(tmp_path, values):
    """score_step over two problems of two samples whose rewards are ``values`` in order."""
    table = iter(values)

    def reward(problem, text):
        return next(table)

    completions = [completion(f"c{index}") for index in range(4)]
    return loop.score_step(reward, PROBLEMS, completions, job_config(tmp_path), step=7)


def test_finite_rewards_give_rewards_and_advantages(tmp_path):
    rewards, advantages = score(tmp_path, [1.0, 0.0, 0.5, 0.5])
    assert rewards.tolist() == [1.0, 0.0, 0.5, 0.5]
    assert advantages[0] > 0 > advantages[1] and advantages[2:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_reward_names_the_step_problem_sample_and_reward(tmp_path, bad):
    with pytest.raises(NonFiniteError) as error:
        score(tmp_path, [1.0, 0.0, 0.5, bad])
    assert str(error.value) == (
        f"step 7: the reward is {bad} for sample 1 of problem 1 of the step ('7+8=', completion "
        "'c3') from task.reward='digit_match'; the step stopped before the update")


def test_a_non_finite_advantage_names_its_group(tmp_path):
    # Finite rewards whose group mean overflows float32.
    with pytest.raises(NonFiniteError, match=r"^step 7: the advantage of sample 0 of problem 0 "
                                             r"is -inf \(its group's rewards: \[3\.\d+e\+38, "
                                             r"3\.\d+e\+38\]\); the step stopped before the "
                                             r"update$"):
        score(tmp_path, [3.4e38, 3.4e38, 0.0, 1.0])


def test_first_non_finite_is_one_check_of_the_whole_tensor():
    assert first_non_finite(torch.tensor([1.0, 2.0])) is None
    assert first_non_finite(torch.tensor([[1.0, 2.0], [math.inf, math.nan]])) == 2


def test_the_plot_skips_non_finite_values(tmp_path):
    rows = [{"step": s, "reward_mean": [0.1, math.inf, math.nan, 0.4][s - 1],
             "logprob_mult_err": [1.0, math.nan, 1.0, math.inf][s - 1], "refit_s": 0.01,
             "eval/reward_mean": -math.inf if s == 2 else 0.5} for s in range(1, 5)]
    path = plot_metrics(rows, tmp_path / "metrics.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plot_that_fails_is_a_warning_and_the_run_goes_on(tmp_path, caplog, monkeypatch):
    config = job_config(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": math.nan})
                                            + "\n")
    console = Console(total=1, initial=0, log_every=0, enabled=True)
    loop._plot(config, console)  # nothing finite to draw: an empty plot, no error
    assert (tmp_path / "metrics.png").is_file()

    def broken(*args, **kwargs):
        raise RuntimeError("the backend broke")

    monkeypatch.setattr(loop, "plot_metrics", broken)
    with caplog.at_level(logging.WARNING, logger="mcore_refit"):
        loop._plot(config, console)
    assert f"could not draw {tmp_path / 'metrics.png'} (the run is complete; `python " \
           f"recipes/plot_metrics.py {tmp_path}` retries): RuntimeError: the backend broke" \
           in caplog.text
