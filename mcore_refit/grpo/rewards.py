"""Reward functions: the built-ins, and users' own named by import path.

A reward function scores one completion (the generated text, stop token removed) against its
problem: ``reward(problem, completion) -> float``. ``task.reward`` names one of
:data:`BUILT_IN_REWARDS` or a function ``package.module:function`` that is imported when the config
is loaded, so a missing module or a wrong signature fails at start-up, not after the first
rollouts.

Built-ins:

- ``exact_match``: 1.0 when the stripped completion equals the stripped answer;
- ``last_number``: the last number in the completion equals the answer as a number;
- ``hash_answer``: the text after the last ``####`` (GSM8K style) equals the answer;
- ``boxed``: the content of the last ``\\boxed{...}`` equals the answer;
- ``digit_match``: partial credit, half for an answer of the right length and half for the share
  of characters right position by position (over the longer of completion and answer); 1.0 only
  for an exact match. It gives a tiny model a gradient towards multi-digit answers long before
  it gets whole answers right, and a short answer never scores as much as one of full length.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence

from mcore_refit.grpo.tasks import Problem, RewardFunction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def exact_match(problem: Problem, completion: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer."""
    return 1.0 if completion.strip() == problem.answer.strip() else 0.0


def last_number(problem: Problem, completion: str) -> float:
    """1.0 when the last number in the completion equals the answer (compared as numbers)."""
    numbers = _NUMBER.findall(completion)
    return 1.0 if numbers and _same_answer(numbers[-1], problem.answer) else 0.0


def hash_answer(problem: Problem, completion: str) -> float:
    """1.0 when the text after the last ``####`` equals the answer (GSM8K's format)."""
    if "####" not in completion:
        return 0.0
    return 1.0 if _same_answer(completion.rsplit("####", 1)[1], problem.answer) else 0.0


def boxed(problem: Problem, completion: str) -> float:
    """1.0 when the content of the last ``\\boxed{...}`` equals the answer."""
    content = last_boxed(completion)
    return 1.0 if content is not None and _same_answer(content, problem.answer) else 0.0


def digit_match(problem: Problem, completion: str) -> float:
    """Half for the answer's length, half for the share of positions where completion and answer
    (stripped) hold the same character, over the longer of the two: 1.0 only for an exact
    match, 0.0 for an empty completion."""
    text, answer = completion.strip(), problem.answer.strip()
    longest = max(len(text), len(answer))
    if longest == 0:
        return 1.0
    matches = sum(a == b for a, b in zip(text, answer, strict=False))
    return 0.5 * (len(text) == len(answer)) + 0.5 * matches / longest


BUILT_IN_REWARDS: dict[str, RewardFunction] = {
    "exact_match": exact_match,
    "last_number": last_number,
    "hash_answer": hash_answer,
    "boxed": boxed,
    "digit_match": digit_match,
}


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


def _same_answer(extracted: str, answer: str) -> bool:
    """Equal as numbers when both are numbers (``1,000`` = ``1000.0``), else as stripped text."""
    extracted, answer = extracted.strip(), answer.strip()
    left, right = _as_number(extracted), _as_number(answer)
    if left is not None and right is not None:
        return math.isclose(left, right, rel_tol=0.0, abs_tol=1e-9)
    return extracted == answer


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def resolve_reward(name: str) -> RewardFunction:
    """The reward function ``name`` names: a built-in, or ``package.module:function``.

    Raises ``ValueError`` when the module or the function is missing, or when the function cannot
    be called as ``reward(problem, completion)``.
    """
    if name in BUILT_IN_REWARDS:
        return BUILT_IN_REWARDS[name]
    module_name, sep, attribute = name.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{name!r} is neither a built-in reward ({', '.join(BUILT_IN_REWARDS)})"
                         " nor an import path 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import the reward module {module_name!r}: {error}") from error
    function = module
    for part in attribute.split("."):
        if not hasattr(function, part):
            raise ValueError(f"the module {module_name!r} has no {attribute!r}")
        function = getattr(function, part)
    check_reward_signature(function, name=name)
    return function


def check_reward_signature(function: Callable, *, name: str) -> None:
    """Raise ``ValueError`` unless ``function(problem, completion)`` binds."""
    if not callable(function):
        raise ValueError(f"{name!r} is not callable")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # a builtin without an introspectable signature: let the first call tell
    try:
        signature.bind(None, None)
    except TypeError as error:
        raise ValueError(f"the reward {name!r} must accept (problem, completion) and return a "
                         f"float; its signature is {signature} ({error})") from None


def score_completions(reward: RewardFunction, problems: Sequence[Problem],
                      completions: Sequence[str], stopped: Sequence[bool], *,
                      truncated_penalty: float) -> list[float]:
    """Rewards for ``completions[i]`` against ``problems[i]``.

    A completion the token budget cut off (``stopped[i]`` false) is scored like any other, less
    ``truncated_penalty`` (the soft overlong penalty of DAPO and verl): what it got right still
    counts, and ending at the stop token pays.
    """
    if not len(problems) == len(completions) == len(stopped):
        raise ValueError(f"{len(completions)} completions and {len(stopped)} stop flags for "
                         f"{len(problems)} problems")
    rewards = []
    for problem, completion, ended in zip(problems, completions, stopped, strict=True):
        value = reward(problem, completion)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"the reward function returned {value!r} ({type(value).__name__}) "
                            "for a completion; it must return a float")
        rewards.append(float(value) - (0.0 if ended else truncated_penalty))
    return rewards
