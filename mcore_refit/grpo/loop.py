"""The GRPO loop on the trainer ranks: generate → score → train → refit, every step.

    rollouts = ColocatedRollouts(...)   # or any other Rollouts (mcore_refit.grpo.protocol)
    summary = run_grpo(config, policy=policy, rollouts=rollouts, ...)

Every function here is a collective over the trainer ranks (call on every one, same order). The
logging rank writes the metrics (:mod:`~mcore_refit.grpo.metrics`), the terminal's bar and
summary lines (:mod:`~mcore_refit.grpo.console`) and, at the end, ``metrics.png``
(:mod:`~mcore_refit.grpo.plot`).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mcore_refit.control import ControlGroup
from mcore_refit.grpo.batch import build_rollout_batch, with_fields
from mcore_refit.grpo.callbacks import CallbackWatchdog
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.grpo.console import Console
from mcore_refit.grpo.evaluation import Evaluator
from mcore_refit.grpo.loss import GRPOLoss, group_advantages, logprob_mult_err
from mcore_refit.grpo.metrics import METRICS_FILE, MetricsWriter, read_metrics, refit_metrics
from mcore_refit.grpo.plot import PLOT_FILE, plot_metrics
from mcore_refit.grpo.protocol import Rollouts
from mcore_refit.grpo.rewards import resolve_reward, score_completions
from mcore_refit.grpo.rundir import RunDirectory, RunState
from mcore_refit.grpo.seeds import derive_seed
from mcore_refit.grpo.tasks import Problem, RewardFunction, excerpt
from mcore_refit.inference.engine import Completion
from mcore_refit.numerics import NonFiniteError, first_non_finite
from mcore_refit.policy.worker import Policy

logger = logging.getLogger(__name__)

@dataclass
class RunHistory:
    """Per-step figures the summary line is made of."""

    rewards: list[float] = field(default_factory=list)
    refit_s: list[float] = field(default_factory=list)
    logprob_mult_err: list[float] = field(default_factory=list)
    eval_rewards: list[float] = field(default_factory=list)


def run_grpo(config: GRPOJobConfig, *, policy: Policy, rollouts: Rollouts, pad_token_id: int,
             device: torch.device, control: ControlGroup, resume: bool) -> dict:
    """Train ``config.run.steps`` GRPO steps; returns the summary (same on every trainer rank).

    ``rollouts`` is where completions come from and new weights go: the loop uses nothing of it
    but the :class:`~mcore_refit.grpo.protocol.Rollouts` calls. ``control``: the trainer ranks'
    host group (checkpoint saves wait on it); its rank 0 writes the metrics and the console.
    """
    is_logging_rank = control.rank == 0
    output_dir = Path(config.run.output_dir)
    run_dir = RunDirectory(output_dir)
    state = run_dir.claim(resume=resume, steps=config.run.steps)
    start_step = resume_from(policy, run_dir, state, config, is_logging_rank) if state else 0
    starts_over = state is None and bool(run_dir.leftovers())
    if starts_over and is_logging_rank:
        _start_over(run_dir, resume=resume)
    task = config.task.build(seed=config.run.seed, hf_path=config.model.hf_path)
    # The task's state is a function of its seed and the problems drawn: replaying the draws
    # of the steps done restores it exactly.
    task.sample(start_step * config.grpo.prompts_per_step)
    loss_fn = GRPOLoss(clip_low=config.grpo.clip_low, clip_high=config.grpo.clip_high,
                       kl_coef=config.grpo.kl_coef)
    # Users' functions: one that hangs ends the run naming itself (run.callback_timeout_s).
    watchdog = CallbackWatchdog(timeout_s=config.run.callback_timeout_s,
                                where=f"trainer rank {control.rank}")
    reward_fn = watchdog.bound(resolve_reward(config.task.reward),
                               name=f"the reward function task.reward={config.task.reward!r}")
    evaluator = Evaluator(config, watchdog=watchdog) if config.eval is not None else None
    # On resume, TensorBoard drops the events of the replayed steps instead of showing them twice.
    metrics_writer = MetricsWriter(config, enabled=is_logging_rank,
                                   purge_step=start_step + 1 if state or starts_over else None)
    history = RunHistory()

    first_refit = rollouts.refit(weight_version=start_step, verify=config.run.verify_refit)
    history.refit_s.append(first_refit.total_s)
    # Colocated: the trainer's state waits on the host while the engine generates; it comes
    # back for training and stays until the refit has read the new weights.
    if config.inference.offload_trainer:
        policy.offload()
    console = Console(total=config.run.steps, initial=start_step,
                      log_every=config.run.log_every, enabled=is_logging_rank)
    for step in range(start_step, config.run.steps):
        started = time.perf_counter()
        problems = task.sample(config.grpo.prompts_per_step)
        groups = rollouts.generate([p.prompt for p in problems],
                                   num_samples=config.grpo.samples_per_prompt,
                                   sampling=config.inference.sampling,
                                   seed=derive_seed(config.run.seed, step))
        generate_s = time.perf_counter() - started
        completions = [c for group in groups for c in group]
        # A reward that fails or is not finite on any rank stops the step on every rank.
        rewards, advantages = control.run_everywhere(
            f"scoring step {step + 1}", score_step, reward_fn, problems, completions, config,
            step=step + 1, who="trainer rank")
        rollout = build_rollout_batch(groups, rewards, advantages, pad_token_id=pad_token_id)

        rollouts.release()
        if config.inference.offload_trainer:
            policy.onload()
        old_logprobs = policy.logprobs(rollout.batch).cpu()
        fields = {"old_logprobs": old_logprobs}
        if config.grpo.kl_coef > 0:
            fields["ref_logprobs"] = policy.reference_logprobs(rollout.batch).cpu()
        mult_err = logprob_mult_err(old_logprobs, rollout.inference_logprobs,
                                    rollout.response_mask)
        train_started = time.perf_counter()
        try:
            metrics = policy.train_step(with_fields(rollout.batch, **fields), loss_fn=loss_fn)
        except NonFiniteError as error:  # raised on every rank: the loss and norm are global
            raise NonFiniteError(f"step {step + 1}: {error}") from None
        train_s = time.perf_counter() - train_started

        refit = rollouts.refit(weight_version=step + 1, verify=config.run.verify_refit)
        # Colocated: the trainer goes back to the host before the evaluation generates (a
        # checkpoint below brings it back for the save).
        if config.inference.offload_trainer:
            policy.offload()
        eval_metrics = {}
        if evaluator is not None and _eval_due(step + 1, config):
            eval_metrics = evaluator.evaluate(rollouts,
                                              seed=derive_seed(config.run.seed, step, "eval"))
            history.eval_rewards.append(eval_metrics["eval/reward_mean"])

        response = rollout.response_mask > 0
        record = {
            "step": step + 1,
            "reward_mean": rewards.mean().item(),
            # Mean logprob of the sampled tokens: near 0 means the policy has collapsed onto
            # single answers (an entropy proxy that costs nothing).
            "sampled_logprob_mean": rollout.inference_logprobs[response].mean().item(),
            "logprob_mult_err": mult_err,
            "completion_tokens_mean": sum(len(c.token_ids) for c in completions) / len(completions),
            "truncated_fraction": sum(not c.stopped for c in completions) / len(completions),
            "loss": metrics.loss,
            "grad_norm": metrics.grad_norm,
            "lr": metrics.lr,
            "tokens": metrics.num_tokens,
            **{f"loss/{k}": v for k, v in metrics.metrics.items()},
            "generate_s": generate_s,
            "train_s": train_s,
            **refit_metrics(refit),
            "step_s": time.perf_counter() - started,
            **eval_metrics,
        }
        history.rewards.append(record["reward_mean"])
        history.refit_s.append(record["refit_s"])
        history.logprob_mult_err.append(mult_err)
        # The row goes out before the checkpoint: a run killed in between resumes from the
        # previous checkpoint and writes this step again, never a checkpoint without its row.
        metrics_writer.log(record)
        if _checkpoint_due(step + 1, config):
            _save_checkpoint(policy, run_dir, config, step=step + 1, control=control)
        console.update(record)
    console.close()
    metrics_writer.close()
    if is_logging_rank and config.run.plot:
        _plot(config, console)
    evaluated = {"eval_reward_last": history.eval_rewards[-1]} if history.eval_rewards else {}
    return {
        "steps": config.run.steps - start_step,
        # --resume: the checkpoint's step this run went on from ("steps" counts those after it).
        **({"resumed_from_step": start_step} if state else {}),
        "reward_first": history.rewards[0] if history.rewards else float("nan"),
        "reward_last": history.rewards[-1] if history.rewards else float("nan"),
        "refit_s_median": statistics.median(history.refit_s) if history.refit_s else 0.0,
        "logprob_mult_err_max": max(history.logprob_mult_err, default=float("nan")),
        "device": device.type,
        "mode": config.refit.mode,
        **evaluated,
    }


def score_step(reward_fn: RewardFunction, problems: Sequence[Problem],
               completions: Sequence[Completion], config: GRPOJobConfig, *,
               step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards and group advantages of one step's completions (``samples_per_prompt`` per
    problem, in order); :class:`~mcore_refit.numerics.NonFiniteError` names the step, the
    reward function, the problem and the sample of the first NaN or infinite one. Local."""
    group_size = config.grpo.samples_per_prompt
    repeated = [p for p in problems for _ in range(group_size)]
    rewards = torch.tensor(score_completions(
        reward_fn, repeated, [c.text for c in completions], [c.stopped for c in completions],
        truncated_penalty=config.grpo.truncated_penalty))
    index = first_non_finite(rewards)
    if index is not None:
        problem, sample = divmod(index, group_size)
        raise NonFiniteError(
            f"step {step}: the reward is {rewards[index].item()} for sample {sample} of problem "
            f"{problem} of the step ({excerpt(problems[problem].prompt)}, completion "
            f"{excerpt(completions[index].text)}) from task.reward={config.task.reward!r}; the "
            "step stopped before the update")
    advantages = group_advantages(rewards, group_size=group_size,
                                  normalize_std=config.grpo.normalize_advantages)
    index = first_non_finite(advantages)
    if index is not None:
        raise NonFiniteError(
            f"step {step}: the advantage of sample {index % group_size} of problem "
            f"{index // group_size} is {advantages[index].item()} (its group's rewards: "
            f"{rewards.view(-1, group_size)[index // group_size].tolist()}); the step stopped "
            "before the update")
    return rewards, advantages


def _plot(config: GRPOJobConfig, console: Console) -> None:
    """Draw ``metrics.png``; a plot that fails is a warning, never the run's failure."""
    output_dir = Path(config.run.output_dir)
    try:
        plot = plot_metrics(read_metrics(output_dir), output_dir / PLOT_FILE,
                            title=f"GRPO, refit.mode={config.refit.mode}, "
                                  f"model {Path(config.model.hf_path).name}")
    except Exception as error:  # the run itself is done and saved
        logger.warning("could not draw %s (the run is complete; `python recipes/plot_metrics.py "
                       "%s` retries): %s: %s", output_dir / PLOT_FILE, output_dir,
                       type(error).__name__, error)
        return
    console.write(f"metrics: {output_dir / METRICS_FILE}, plot: {plot}")


def _eval_due(step: int, config: GRPOJobConfig) -> bool:
    every = config.run.eval_every
    return step == config.run.steps or (every > 0 and step % every == 0)


def _checkpoint_due(step: int, config: GRPOJobConfig) -> bool:
    every = config.run.checkpoint_every
    return step == config.run.steps or (every > 0 and step % every == 0)


def _save_checkpoint(policy: Policy, run_dir: RunDirectory, config: GRPOJobConfig, *,
                     step: int, control: ControlGroup) -> None:
    """Checkpoint ``step``; an offloaded trainer comes back for the save and leaves again."""
    offloaded = policy.offloaded
    if offloaded:
        policy.onload()
    run_dir.save_checkpoint(policy, step=step, extra={"optimizer": _optimizer_settings(config)},
                            control=control, keep=config.run.keep_checkpoints)
    if offloaded:
        policy.offload()


def resume_from(policy: Policy, run_dir: RunDirectory, state: RunState, config: GRPOJobConfig,
                is_logging_rank: bool) -> int:
    """Load ``state``'s checkpoint and drop what the run wrote after it; returns its step.

    Refuses optimizer settings other than those the checkpoint was trained with. Collective over
    the trainer ranks.
    """
    check_same_optimizer(state, config, run_dir=run_dir)
    if state.passed_over is not None and is_logging_rank:
        logger.warning("--resume: passing over a damaged checkpoint (%s); resuming from %s "
                       "(step %d)", state.passed_over, state.checkpoint, state.step)
    policy.load_checkpoint(state.checkpoint)
    if is_logging_rank:
        run_dir.prepare_resume(state)
    return state.step


def _start_over(run_dir: RunDirectory, *, resume: bool) -> None:
    """A run at step 0 in a directory a run left without a checkpoint: say what it replaces,
    then forget it (logging rank)."""
    why = ("--resume: no checkpoint to resume from" if resume
           else "a run that saved no checkpoint was here")
    logger.warning("%s in run.output_dir %r; starting at step 0 and replacing %s", why,
                   str(run_dir.path), ", ".join(run_dir.leftovers()))
    run_dir.prepare_resume(None)


def check_same_optimizer(state: RunState, config: GRPOJobConfig, *,
                         run_dir: RunDirectory) -> None:
    """Refuse to resume ``state`` with optimizer settings other than the run's."""
    saved = state.extra.get("optimizer")
    current = _optimizer_settings(config)
    if saved is None or saved == current:
        return
    changed = ", ".join(f"policy.optimizer.{key}={current.get(key)!r} (checkpoint: "
                        f"{saved.get(key)!r})" for key in sorted(set(saved) | set(current))
                        if saved.get(key) != current.get(key))
    raise ValueError(f"--resume: {changed} differs from the run in {str(run_dir.path)!r}; a "
                     "resumed run keeps the optimizer settings it was started with (its "
                     "optimizer state and schedule are restored as saved): restore them, or "
                     "start a new run from the checkpoint's weights")


def _optimizer_settings(config: GRPOJobConfig) -> dict:
    return dataclasses.asdict(config.policy.optimizer)
