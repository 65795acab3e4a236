"""Built-in rewards, rewards by import path, scoring with the truncation rule."""

import re
import sys
import types

import pytest

from mcore_refit.config import ConfigError, load_config
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.grpo.rewards import (
    BUILT_IN_REWARDS,
    boxed,
    digit_match,
    exact_match,
    hash_answer,
    last_boxed,
    last_number,
    resolve_reward,
    score_completions,
)
from mcore_refit.grpo.tasks import Problem


def scores(reward, answer, completions):
    return [reward(Problem("p", answer), c) for c in completions]


def test_exact_match():
    assert scores(exact_match, "3", ["3", " 3\n", "33", ""]) == [1.0, 1.0, 0.0, 0.0]


def test_last_number():
    assert scores(last_number, "1000", ["so 12 then 1,000", "1000.0", "-1000", "10 then 5",
                                        "none", "1000."]) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert scores(last_number, "-3.5", ["x = -3.5", "3.5"]) == [1.0, 0.0]


def test_hash_answer():
    assert scores(hash_answer, "72", ["work #### 72", "#### 7 #### 72\n", "#### 71", "72",
                                      "####72"]) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert scores(hash_answer, "cat", ["#### cat ", "#### dog"]) == [1.0, 0.0]


def test_boxed():
    assert last_boxed(r"\boxed{1} and \boxed{\frac{1}{2}} end") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{unclosed") is None and last_boxed("none") is None
    assert scores(boxed, "12", [r"so \boxed{12}.", r"\boxed{ 12 }", r"\boxed{13}", "12"]) == [
        1.0, 1.0, 0.0, 0.0]


def test_digit_match_gives_partial_credit_and_full_credit_only_when_exact():
    assert scores(digit_match, "23", ["23", "24", "2", "13", "234", "", " 23 ", "x"]) == [
        1.0, 0.75, 0.25, 0.75, 1 / 3, 0.0, 1.0, 0.0]


def test_built_ins_resolve_by_name():
    for name, function in BUILT_IN_REWARDS.items():
        assert resolve_reward(name) is function


@pytest.fixture
def reward_module(monkeypatch):
    module = types.ModuleType("user_rewards")
    module.good = lambda problem, completion: float(completion == problem.answer[::-1])
    module.wrong = lambda completion: 1.0
    module.constant = 3
    monkeypatch.setitem(sys.modules, "user_rewards", module)
    return module


def test_reward_by_import_path(reward_module):
    assert resolve_reward("user_rewards:good") is reward_module.good
    config = load_config(GRPOJobConfig, None, ["model.hf_path=x", "task.reward=user_rewards:good"])
    assert config.task.reward == "user_rewards:good"


@pytest.mark.parametrize("name, message", [
    ("nope", "task.reward: 'nope' is neither a built-in reward (exact_match, last_number, "
             "hash_answer, boxed, digit_match) nor an import path 'package.module:function'"),
    ("no_such_module_xyz:f", "task.reward: cannot import the reward module "
                             "'no_such_module_xyz': No module named 'no_such_module_xyz'"),
    ("user_rewards:missing", "task.reward: the module 'user_rewards' has no 'missing'"),
    ("user_rewards:constant", "task.reward: 'user_rewards:constant' is not callable"),
    ("user_rewards:wrong", "task.reward: the reward 'user_rewards:wrong' must accept (problem, "
                           "completion) and return a float; its signature is (completion)"),
])
def test_a_bad_reward_fails_at_start_up_naming_the_key(reward_module, name, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(GRPOJobConfig, None, ["model.hf_path=x", f"task.reward={name}"])


def test_score_completions_applies_the_truncated_penalty():
    problems = [Problem("p", "7")] * 4
    assert score_completions(exact_match, problems, ["7", "7", "1", "1"],
                             [True, False, True, False], truncated_penalty=0.5) == [
        1.0, 0.5, 0.0, -0.5]
    assert score_completions(exact_match, problems, ["7", "7", "1", "1"],
                             [True, False, True, False], truncated_penalty=0.0) == [
        1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 completions and 2 stop flags for 4 problems"):
        score_completions(exact_match, problems, ["7", "7"], [True, True], truncated_penalty=0.0)
    with pytest.raises(TypeError, match=re.escape("the reward function returned '1' (str)")):
        score_completions(lambda p, c: "1", problems[:1], ["7"], [True], truncated_penalty=0.0)
