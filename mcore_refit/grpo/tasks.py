"""Prompts with verifiable answers, and the rewards that score completions against them.

A task is an iterable source of :class:`Problem` batches; a reward function scores one completion
against its problem. The built-in :class:`ArithmeticTask` is generated from a seed (no data to
ship); :class:`JsonlTask` reads users' own ``{"prompt": ..., "answer": ...}`` lines.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, get_args

from mcore_refit.config import ConfigError


@dataclass(frozen=True)
class Problem:
    """One prompt and the answer a correct completion contains."""

    prompt: str
    answer: str


class RewardFunction(Protocol):
    """Scores ``completion`` (the generated text, stop token removed) for ``problem``."""

    def __call__(self, problem: Problem, completion: str) -> float:
        ...


class ExactMatchReward:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer; else 0.0."""

    def __call__(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion.strip() == problem.answer else 0.0


class Task(Protocol):
    """An endless, seeded source of problems."""

    def sample(self, num_problems: int) -> list[Problem]:
        """The next ``num_problems`` problems (deterministic for a given seed and call order)."""
        ...


Operation = Literal["add", "sub", "mul"]
_SYMBOLS = {"add": "+", "sub": "-", "mul": "*"}


def check_arithmetic_settings(*, num_digits: int, operation: str, modulo: int | None,
                              max_operand: int | None) -> None:
    """Reject settings no :class:`ArithmeticTask` can have: a :class:`ConfigError` with its keys
    relative to the task's config section (``task``)."""
    if num_digits < 1:
        raise ConfigError(f"`num_digits` must be ≥ 1, got {num_digits}")
    if operation not in get_args(Operation):
        raise ConfigError(f"`operation` must be one of {list(get_args(Operation))}, "
                          f"got {operation!r}")
    if modulo is not None and modulo < 2:
        raise ConfigError(f"`modulo` must be ≥ 2 or null, got {modulo}")
    if max_operand is not None and not 0 < max_operand < 10 ** num_digits:
        raise ConfigError(f"`max_operand` must be in [1, {10 ** num_digits - 1}] for "
                          f"num_digits={num_digits}, got {max_operand}")


@dataclass(kw_only=True)
class ArithmeticTask:
    """``a<op>b=`` → the decimal result, operands of up to ``num_digits`` digits.

    ``max_operand`` narrows the operands to ``[0, max_operand]`` (operands up to 4 give one-digit
    sums, which a tiny model learns within minutes on a CPU); with ``modulo`` set the answer is
    the result modulo it.
    """

    seed: int = 0
    num_digits: int = 1
    operation: Operation = "add"
    modulo: int | None = None
    max_operand: int | None = None

    def __post_init__(self) -> None:
        try:
            check_arithmetic_settings(num_digits=self.num_digits, operation=self.operation,
                                      modulo=self.modulo, max_operand=self.max_operand)
        except ConfigError as error:
            raise error.at("task") from None
        self._rng = random.Random(self.seed)

    def sample(self, num_problems: int) -> list[Problem]:
        high = self.max_operand if self.max_operand is not None else 10 ** self.num_digits - 1
        problems = []
        for _ in range(num_problems):
            a, b = self._rng.randint(0, high), self._rng.randint(0, high)
            result = {"add": a + b, "sub": a - b, "mul": a * b}[self.operation]
            if self.modulo is not None:
                result %= self.modulo
            problems.append(Problem(prompt=f"{a}{_SYMBOLS[self.operation]}{b}=",
                                    answer=str(result)))
        return problems


@dataclass(kw_only=True)
class JsonlTask:
    """Problems from a JSON-lines file of ``{"prompt": str, "answer": str}``, shuffled per epoch."""

    path: str
    seed: int = 0

    def __post_init__(self) -> None:
        self._problems = load_jsonl_problems(self.path)
        self._rng = random.Random(self.seed)
        self._order: list[int] = []

    def sample(self, num_problems: int) -> list[Problem]:
        problems = []
        while len(problems) < num_problems:
            if not self._order:
                self._order = list(range(len(self._problems)))
                self._rng.shuffle(self._order)
            problems.append(self._problems[self._order.pop()])
        return problems


def load_jsonl_problems(path: str | Path) -> list[Problem]:
    """Read ``{"prompt", "answer"}`` lines; errors name the file, the line and the problem."""
    problems = []
    text = Path(path).read_text()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg})") from error
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected an object with 'prompt' and 'answer'")
        for key in ("prompt", "answer"):
            if not isinstance(record.get(key), str) or not record[key]:
                raise ValueError(f"{where}: '{key}' must be a non-empty string")
        problems.append(Problem(prompt=record["prompt"], answer=record["answer"]))
    if not problems:
        raise ValueError(f"{path}: no problems found")
    return problems


def score(reward: RewardFunction, problems: Sequence[Problem],
          completions: Sequence[str]) -> list[float]:
    """Rewards for ``completions[i]`` against ``problems[i]``."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(completions)} completions for {len(problems)} problems")
    return [float(reward(problem, completion))
            for problem, completion in zip(problems, completions, strict=True)]
