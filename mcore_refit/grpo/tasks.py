"""Prompts with verifiable answers.

A task is an endless, seeded source of :class:`Problem` batches; a reward function
(:mod:`mcore_refit.grpo.rewards`) scores one completion against its problem. The built-in
:class:`ArithmeticTask` is generated from a seed (no data to ship); :class:`JsonlTask` reads users'
own JSON lines, with the prompt and answer under keys of their choice. :meth:`TaskConfig.build
<mcore_refit.grpo.config.TaskConfig.build>` makes either from the config and dresses its prompts
(:func:`dress_prompts`: ``task.prompt_template``, then the tokenizer's chat template when
``task.chat_template`` is set).
"""

from __future__ import annotations

import json
import math
import random
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

from mcore_refit.config import ConfigError


@dataclass(frozen=True)
class Problem:
    """One prompt and the answer a correct completion contains.

    ``record`` holds the other keys of a JSONL line (custom rewards may read them).
    """

    prompt: str
    answer: str
    record: Mapping[str, Any] = field(default_factory=dict)


class RewardFunction(Protocol):
    """Scores ``completion`` (the generated text, stop token removed) for ``problem``."""

    def __call__(self, problem: Problem, completion: str) -> float:
        ...


class Task(Protocol):
    """An endless, seeded source of problems."""

    def sample(self, num_problems: int) -> list[Problem]:
        """The next ``num_problems`` problems (deterministic for a given seed and call order)."""
        ...


Operation = Literal["add", "sub", "mul"]
_SYMBOLS = {"add": "+", "sub": "-", "mul": "*"}


def check_arithmetic_settings(*, num_digits: int, operation: str, modulo: int | None,
                              max_operand: int | None, min_operand: int = 0) -> None:
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
    high = max_operand if max_operand is not None else 10 ** num_digits - 1
    if not 0 <= min_operand <= high:
        raise ConfigError(f"`min_operand` must be in [0, {high}], got {min_operand}")


@dataclass(kw_only=True)
class ArithmeticTask:
    """``a<op>b=`` → the decimal result, operands of up to ``num_digits`` digits.

    ``min_operand`` and ``max_operand`` narrow the operands to ``[min_operand, max_operand]``
    (operands up to 4 give one-digit sums, which a tiny model learns within minutes on a CPU;
    operands from 5 to 9 give two-digit sums whose tens digit is always 1); with ``modulo`` set
    the answer is the result modulo it.
    """

    seed: int = 0
    num_digits: int = 1
    operation: Operation = "add"
    modulo: int | None = None
    max_operand: int | None = None
    min_operand: int = 0

    def __post_init__(self) -> None:
        try:
            check_arithmetic_settings(num_digits=self.num_digits, operation=self.operation,
                                      modulo=self.modulo, max_operand=self.max_operand,
                                      min_operand=self.min_operand)
        except ConfigError as error:
            raise error.at("task") from None
        self._rng = random.Random(self.seed)

    def sample(self, num_problems: int) -> list[Problem]:
        high = self.max_operand if self.max_operand is not None else 10 ** self.num_digits - 1
        problems = []
        for _ in range(num_problems):
            a, b = (self._rng.randint(self.min_operand, high),
                    self._rng.randint(self.min_operand, high))
            result = {"add": a + b, "sub": a - b, "mul": a * b}[self.operation]
            if self.modulo is not None:
                result %= self.modulo
            problems.append(Problem(prompt=f"{a}{_SYMBOLS[self.operation]}{b}=",
                                    answer=str(result)))
        return problems


@dataclass(kw_only=True)
class JsonlTask:
    """Problems from a JSON-lines file, shuffled per epoch.

    Each line is an object holding the prompt under ``prompt_key`` and the answer (a string or a
    number) under ``answer_key``.
    """

    path: str
    seed: int = 0
    prompt_key: str = "prompt"
    answer_key: str = "answer"

    def __post_init__(self) -> None:
        self.problems = load_jsonl_problems(self.path, prompt_key=self.prompt_key,
                                            answer_key=self.answer_key)
        self._rng = random.Random(self.seed)
        self._order: list[int] = []

    def sample(self, num_problems: int) -> list[Problem]:
        problems = []
        while len(problems) < num_problems:
            if not self._order:
                self._order = list(range(len(self.problems)))
                self._rng.shuffle(self._order)
            problems.append(self.problems[self._order.pop()])
        return problems


def load_jsonl_problems(path: str | Path, *, prompt_key: str = "prompt",
                        answer_key: str = "answer") -> list[Problem]:
    """Read one problem per line; errors name the file, the line and the problem."""
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
            raise ValueError(f"{where}: expected an object with '{prompt_key}' and "
                             f"'{answer_key}'")
        prompt, answer = record.get(prompt_key), record.get(answer_key)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: '{prompt_key}' must be a non-empty string")
        if isinstance(answer, float) and not math.isfinite(answer):
            # Python's json reads NaN and Infinity; as an answer they would become "nan".
            raise ValueError(f"{where}: '{answer_key}' is {answer}, not a finite number; quote "
                             "it if that text is the answer")
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str) or not answer:
            raise ValueError(f"{where}: '{answer_key}' must be a non-empty string or a number")
        rest = {k: v for k, v in record.items() if k not in (prompt_key, answer_key)}
        problems.append(Problem(prompt=prompt, answer=answer, record=rest))
    if not problems:
        raise ValueError(f"{path}: no problems found")
    return problems


def excerpt(text: str, limit: int = 60) -> str:
    """``text`` quoted for a message: its repr, cut after ``limit`` characters (``…``)."""
    return repr(text[:limit]) + ("…" if len(text) > limit else "")


def template_fields(template: str) -> set[str]:
    """The names a ``str.format`` template refers to (``{prompt}`` → ``{"prompt"}``)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as error:
        raise ConfigError(f"`prompt_template` is not a valid format string: {error}") from None
    names = {name for _, name, _, _ in parsed if name is not None}
    if "" in names or any(name.isdigit() for name in names):
        raise ConfigError("`prompt_template` must name its fields ({prompt}, {other_key}), "
                          f"got {template!r}")
    return names


class PromptedTask:
    """A task whose prompts go through ``format_prompt`` (template, chat template)."""

    def __init__(self, task: Task, format_prompt: Callable[[Problem], str]) -> None:
        self._task = task
        self._format = format_prompt

    def sample(self, num_problems: int) -> list[Problem]:
        return [Problem(prompt=self._format(p), answer=p.answer, record=p.record)
                for p in self._task.sample(num_problems)]


def dress_prompts(task: Task, *, template: str | None, chat_template: bool,
                  hf_path: str) -> Task:
    """``task`` with its prompts put through ``template`` (a ``str.format`` template over
    ``{prompt}`` and the problem's record) and, with ``chat_template``, the tokenizer's chat
    template at ``hf_path`` (read only then; a tokenizer without one is a ``ValueError``)."""
    if template is None and not chat_template:
        return task
    chat = _chat_formatter(hf_path) if chat_template else None

    def format_prompt(problem: Problem) -> str:
        text = problem.prompt
        if template is not None:
            try:
                text = template.format(**{**problem.record, "prompt": problem.prompt})
            except KeyError as error:
                raise ValueError(f"task.prompt_template names {error}, which the problem "
                                 f"{problem.prompt!r} does not have") from None
        return chat(text) if chat is not None else text

    return PromptedTask(task, format_prompt)


def _chat_formatter(hf_path: str) -> Callable[[str], str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"task.chat_template is true but the tokenizer in {hf_path} has no chat "
                         "template")

    def chat(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    return chat
