"""Scoring a fixed validation set with greedy decoding, for the ``eval/*`` metrics.

The set is drawn once at start-up (``eval.num_problems`` problems of the seeded task, or every line
of a jsonl file) and scored with one greedy completion per prompt through the same rollouts
backend as training, so it measures the weights the engines hold after the last refit.
"""

from __future__ import annotations

import dataclasses

from mcore_refit.config import ConfigError
from mcore_refit.grpo.callbacks import CallbackWatchdog
from mcore_refit.grpo.config import EvalConfig, GRPOJobConfig
from mcore_refit.grpo.rewards import resolve_reward, score_completions
from mcore_refit.grpo.tasks import Problem, load_jsonl_problems

# A few of each evaluation's completions (prompt, completion, reward) go to the metrics and the
# terminal under this key.
SAMPLES_KEY = "eval/samples"
NUM_SAMPLES = 3
# Offsets the eval set's seed from the training task's, so an arithmetic eval set is not the
# first prompts the training run sees.
EVAL_SEED_OFFSET = 7919


class Evaluator:
    """The validation set and how to score it; :meth:`evaluate` is a collective over the trainer
    ranks (it calls the rollouts backend's ``generate``)."""

    def __init__(self, config: GRPOJobConfig, *, watchdog: CallbackWatchdog | None = None) -> None:
        """``watchdog`` bounds the reward function's calls."""
        assert config.eval is not None
        eval_config: EvalConfig = config.eval
        self.problems = draw_eval_set(eval_config, seed=config.run.seed + EVAL_SEED_OFFSET,
                                      hf_path=config.model.hf_path)
        key = "eval.reward" if eval_config.reward is not None else "task.reward"
        reward = eval_config.reward if eval_config.reward is not None else config.task.reward
        self._reward = resolve_reward(reward)
        if watchdog is not None:
            self._reward = watchdog.bound(self._reward,
                                          name=f"the reward function {key}={reward!r}")
        self._truncated_penalty = config.grpo.truncated_penalty
        self._sampling = dataclasses.replace(config.inference.sampling, greedy=True)

    def evaluate(self, rollouts, *, seed: int) -> dict[str, float]:
        """``eval/*`` metrics of the engines' current weights.

        Greedy decoding draws no random numbers, so the same weights give the same metrics (a
        resumed run's equal an uninterrupted one's); ``seed`` goes to the engines' sampler all
        the same, which keeps its state a function of the step.
        """
        groups = rollouts.generate([p.prompt for p in self.problems], num_samples=1,
                                   sampling=self._sampling, seed=seed)
        completions = [group[0] for group in groups]
        rewards = score_completions(self._reward, self.problems, [c.text for c in completions],
                                    [c.stopped for c in completions],
                                    truncated_penalty=self._truncated_penalty)
        num = len(completions)
        return {
            "eval/reward_mean": sum(rewards) / num,
            # Full credit (1.0 or more): the share of answers right under partial-credit rewards.
            "eval/accuracy": sum(r >= 1.0 for r in rewards) / num,
            "eval/truncated_fraction": sum(not c.stopped for c in completions) / num,
            "eval/completion_tokens_mean": sum(len(c.token_ids) for c in completions) / num,
            # What the model writes, on the same first problems at every evaluation.
            SAMPLES_KEY: [{"prompt": problem.prompt, "completion": completion.text,
                           "reward": reward}
                          for problem, completion, reward in zip(
                              self.problems[:NUM_SAMPLES], completions, rewards)],
        }


def draw_eval_set(config: EvalConfig, *, seed: int, hf_path: str) -> list[Problem]:
    """The fixed list of validation problems ``config`` describes."""
    task = config.build(seed=seed, hf_path=hf_path)
    if config.kind != "jsonl":
        return task.sample(config.num_problems)
    rows = len(load_jsonl_problems(config.path, prompt_key=config.prompt_key,
                                   answer_key=config.answer_key))
    if config.num_problems is not None and config.num_problems > rows:
        # The task would start a second epoch: the same problems scored twice.
        raise ConfigError(f"`num_problems`={config.num_problems} is more than the {rows} "
                          f"problems in {config.path}; set it to at most {rows}, or null for "
                          "every line once")
    # Every line once (one epoch of the file), or that many of them.
    return task.sample(rows if config.num_problems is None else config.num_problems)
