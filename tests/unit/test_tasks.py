"""Built-in task, JSONL loader with custom keys, prompt templates and chat templates."""

import dataclasses
import json
import re

import pytest

from mcore_refit.config import ConfigError, load_config
from mcore_refit.grpo.config import EvalConfig, GRPOJobConfig, TaskConfig
from mcore_refit.grpo.evaluation import draw_eval_set
from mcore_refit.grpo.tasks import ArithmeticTask, JsonlTask, Problem
from mcore_refit.tiny import build_tokenizer


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


def test_jsonl_task(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": "2"}\n')
    task = JsonlTask(path=str(path), seed=0)
    drawn = task.sample(4)
    assert sorted(p.prompt for p in drawn[:2]) == ["a", "b"]  # one epoch holds each once
    assert sorted(p.prompt for p in drawn[2:]) == ["a", "b"]


def test_jsonl_task_with_custom_keys_keeps_the_other_keys(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "2+2?", "solution": 4, "level": "easy"}\n')
    [problem] = JsonlTask(path=str(path), prompt_key="question", answer_key="solution").sample(1)
    assert problem == Problem(prompt="2+2?", answer="4", record={"level": "easy"})


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\n', ":1: 'answer' must be a non-empty string or a number"),
    ('{"prompt": "a", "answer": "1"}\nnot json\n', ":2: not valid JSON"),
    ('[1, 2]\n', ":1: expected an object with 'prompt' and 'answer'"),
    ('{"prompt": "", "answer": "1"}\n', ":1: 'prompt' must be a non-empty string"),
    ('{"prompt": "a", "answer": true}\n', ":1: 'answer' must be a non-empty string or a number"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": NaN}\n',
     ":2: 'answer' is nan, not a finite number; quote it if that text is the answer"),
    ('{"prompt": "a", "answer": -Infinity}\n',
     ":1: 'answer' is -inf, not a finite number; quote it if that text is the answer"),
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


def test_prompt_template_uses_the_prompt_and_the_lines_keys(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"q": "2+2", "a": "4", "topic": "sums"}\n')
    config = TaskConfig(kind="jsonl", path=str(path), prompt_key="q", answer_key="a",
                        prompt_template="[{topic}] {prompt} =")
    [problem] = config.build(seed=0, hf_path="unused").sample(1)
    assert (problem.prompt, problem.answer) == ("[sums] 2+2 =", "4")
    arithmetic = TaskConfig(prompt_template="Q: {prompt}").build(seed=5, hf_path="unused")
    assert [p.prompt for p in arithmetic.sample(3)] == [
        f"Q: {p.prompt}" for p in ArithmeticTask(seed=5).sample(3)]


def test_a_template_key_missing_from_a_line_names_it(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "2+2", "answer": "4"}\n')
    task = TaskConfig(kind="jsonl", path=str(path),
                      prompt_template="{topic}: {prompt}").build(seed=0, hf_path="unused")
    with pytest.raises(ValueError, match=re.escape(
            "task.prompt_template names 'topic', which the problem '2+2' does not have")):
        task.sample(1)


def test_chat_template_wraps_the_prompt_when_the_tokenizer_has_one(tmp_path):
    tokenizer = build_tokenizer()
    without = tmp_path / "plain"
    tokenizer.save_pretrained(without)
    config = TaskConfig(chat_template=True, prompt_template="Add {prompt}")
    with pytest.raises(ValueError, match=re.escape(
            f"task.chat_template is true but the tokenizer in {without} has no chat template")):
        config.build(seed=0, hf_path=str(without))
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
                               "</s>{% endfor %}{% if add_generation_prompt %}<s>bot: {% endif %}")
    with_chat = tmp_path / "chat"
    tokenizer.save_pretrained(with_chat)
    [problem] = config.build(seed=0, hf_path=str(with_chat)).sample(1)
    [plain] = ArithmeticTask(seed=0).sample(1)
    assert problem.prompt == f"<s>user: Add {plain.prompt}</s><s>bot: "
    assert problem.answer == plain.answer


@pytest.mark.parametrize("overrides, message", [
    (["task.path=x.jsonl"], "task.path is only used with task.kind=jsonl"),
    (["task.prompt_key=q"], "task.prompt_key is only used with task.kind=jsonl"),
    (["task.kind=jsonl"], "task.kind=jsonl needs task.path"),
    (["task.prompt_template=Q {prompt} {level}"],
     "task.prompt_template may only use {prompt} with task.kind=arithmetic, got ['level', "
     "'prompt']"),
    (["task.prompt_template=Q {}"], "task.prompt_template must name its fields"),
    (["eval.num_problems=null"], "eval.num_problems may only be null with eval.kind=jsonl"),
    (["eval.num_problems=0"], "eval.num_problems must be ≥ 1 or null, got 0"),
    (["eval=null", "run.eval_every=5"], "run.eval_every > 0 needs an eval section"),
    (["run.eval_every=-1"], "run.eval_every must be ≥ 0, got -1"),
    (["grpo.truncated_penalty=-1"], "grpo.truncated_penalty must be ≥ 0, got -1.0"),
])
def test_bad_task_and_eval_config(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(GRPOJobConfig, None, ["model.hf_path=x", "eval.kind=arithmetic", *overrides])


def test_eval_set_is_fixed_and_apart_from_training(tmp_path):
    config = EvalConfig(num_digits=2, num_problems=5)
    first = draw_eval_set(config, seed=1, hf_path="unused")
    assert first == draw_eval_set(config, seed=1, hf_path="unused") and len(first) == 5
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i}+1", "a": i + 1}) + "\n" for i in range(7)))
    every_line = EvalConfig(kind="jsonl", path=str(path), prompt_key="q", answer_key="a",
                            num_problems=None)
    drawn = draw_eval_set(every_line, seed=0, hf_path="unused")
    assert sorted(p.prompt for p in drawn) == sorted(f"{i}+1" for i in range(7))


def test_an_eval_set_larger_than_its_file_is_refused(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i}+1", "a": i + 1}) + "\n" for i in range(7))
                    + json.dumps({"q": "nan?", "a": "NaN"}) + "\n")  # a string stays one
    config = EvalConfig(kind="jsonl", path=str(path), prompt_key="q", answer_key="a",
                        num_problems=9)
    with pytest.raises(ConfigError) as raised:
        draw_eval_set(config, seed=0, hf_path="unused")
    assert str(raised.value.at("eval")) == (
        f"eval.num_problems=9 is more than the 8 problems in {path}; set it to at most 8, or "
        "null for every line once")
    drawn = draw_eval_set(dataclasses.replace(config, num_problems=8), seed=0, hf_path="unused")
    assert len({p.prompt for p in drawn}) == 8 and "NaN" in {p.answer for p in drawn}


def test_min_operand_bounds_operands_from_below():
    for problem in ArithmeticTask(seed=2, min_operand=5, max_operand=9).sample(100):
        a, b = map(int, problem.prompt.rstrip("=").split("+"))
        assert 5 <= a <= 9 and 5 <= b <= 9 and problem.answer == str(a + b)
    with pytest.raises(ValueError, match=re.escape("task.min_operand must be in [0, 4], got 5")):
        ArithmeticTask(min_operand=5, max_operand=4)
