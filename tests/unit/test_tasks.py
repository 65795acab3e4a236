"""Built-in task, JSONL loader and rewards."""

import re

import pytest

from mcore_refit.grpo.tasks import ArithmeticTask, ExactMatchReward, JsonlTask, Problem, score


def test_arithmetic_task_is_seeded_and_correct():
    first = ArithmeticTask(seed=3, num_digits=2).sample(50)
    assert first == ArithmeticTask(seed=3, num_digits=2).sample(50)
    assert first != ArithmeticTask(seed=4, num_digits=2).sample(50)
    for problem in first:
        a, b = problem.prompt.rstrip("=").split("+")
        assert int(problem.answer) == int(a) + int(b)
        assert len(a) <= 2 and len(b) <= 2
    for problem in ArithmeticTask(seed=0, modulo=10, operation="mul").sample(50):
        a, b = problem.prompt.rstrip("=").split("*")
        assert problem.answer == str(int(a) * int(b) % 10)


def test_exact_match_reward():
    reward = ExactMatchReward()
    problems = [Problem("1+2=", "3")] * 3
    assert score(reward, problems, ["3", " 3\n", "33"]) == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="2 completions for 3 problems"):
        score(reward, problems, ["3", "3"])


def test_jsonl_task(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": "2"}\n')
    task = JsonlTask(path=str(path), seed=0)
    drawn = task.sample(4)
    assert sorted(p.prompt for p in drawn[:2]) == ["a", "b"]  # one epoch holds each once
    assert sorted(p.prompt for p in drawn[2:]) == ["a", "b"]


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\n', ":1: 'answer' must be a non-empty string"),
    ('{"prompt": "a", "answer": "1"}\nnot json\n', ":2: not valid JSON"),
    ('[1, 2]\n', ":1: expected an object with 'prompt' and 'answer'"),
    ("\n", ": no problems found"),
])
def test_jsonl_errors_name_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(f"{path}{message}")):
        JsonlTask(path=str(path))


def test_bad_task_settings():
    with pytest.raises(ValueError, match=re.escape("task.num_digits must be ≥ 1, got 0")):
        ArithmeticTask(num_digits=0)
    with pytest.raises(ValueError, match=re.escape("task.modulo must be ≥ 2 or null, got 1")):
        ArithmeticTask(modulo=1)
    with pytest.raises(ValueError, match=re.escape(
            "task.max_operand must be in [1, 9] for num_digits=1, got 10")):
        ArithmeticTask(max_operand=10)


def test_max_operand_bounds_operands():
    for problem in ArithmeticTask(seed=1, max_operand=4).sample(100):
        a, b = map(int, problem.prompt.rstrip("=").split("+"))
        assert 0 <= a <= 4 and 0 <= b <= 4 and problem.answer == str(a + b)
