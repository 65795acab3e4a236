"""A GRPO run's metrics as one PNG: reward (train and eval), refit time and ``mult_err`` per step.

    plot_metrics(read_metrics(run_dir), run_dir / "metrics.png", title=...)

Drawn with matplotlib's object API (no pyplot, no global backend state), so it runs headless.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mcore_refit.grpo.console import EVAL_REWARD

PLOT_FILE = "metrics.png"


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value and the ``window − 1`` before it (fewer at the start)."""
    if window < 1:
        raise ValueError(f"window must be ≥ 1, got {window}")
    averages, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        averages.append(total / min(index + 1, window))
    return averages


def reward_limits(values: Sequence[float], *, margin: float = 0.02) -> tuple[float, float]:
    """The reward axis: [0, 1] unless a penalty (truncation) or a bonus goes outside it."""
    return min([0.0, *values]) - margin, max([1.0, *values]) + margin


def finite_points(records: Sequence[dict[str, Any]], key: str) -> tuple[list, list[float]]:
    """``(steps, values)`` of the records whose ``key`` is a finite number: a NaN or infinite
    value (or none) leaves a gap in the line rather than failing the plot or its axis."""
    points = [(r["step"], r[key]) for r in records
              if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [step for step, _ in points], [value for _, value in points]


def plot_metrics(records: Sequence[dict[str, Any]], path: str | Path, *,
                 title: str = "GRPO run") -> Path:
    """Draw ``records`` (metrics.jsonl rows) into a PNG at ``path``; returns the path."""
    from matplotlib.figure import Figure

    if not records:
        raise ValueError("no metrics to plot: the run logged no step")
    steps, rewards = finite_points(records, "reward_mean")
    figure = Figure(figsize=(7.5, 8.0), layout="constrained")
    reward_ax, refit_ax, err_ax = figure.subplots(3, 1, sharex=True)
    figure.suptitle(title)

    window = max(1, len(steps) // 15)
    reward_ax.plot(steps, rewards, color="tab:blue", alpha=0.3, linewidth=1,
                   label="train (per step)")
    reward_ax.plot(steps, moving_average(rewards, window), color="tab:blue", linewidth=2,
                   label=f"train ({window}-step mean)")
    eval_steps, eval_rewards = finite_points(records, EVAL_REWARD)
    if eval_steps:
        reward_ax.plot(eval_steps, eval_rewards, color="tab:orange", marker="o", linewidth=1.5,
                       label="eval (greedy)")
    reward_ax.set_ylabel("mean reward")
    reward_ax.set_ylim(*reward_limits(rewards + eval_rewards))
    reward_ax.grid(alpha=0.3)
    reward_ax.legend(loc="upper left", fontsize="small")

    refit_steps, refit_s = finite_points(records, "refit_s")
    refit_ax.plot(refit_steps, [value * 1e3 for value in refit_s], color="tab:green",
                  linewidth=1)
    refit_ax.set_ylabel("refit time (ms)")
    refit_ax.set_ylim(bottom=0)
    refit_ax.grid(alpha=0.3)

    err_steps, mult_err = finite_points(records, "logprob_mult_err")
    err_ax.plot(err_steps, [value - 1.0 for value in mult_err], color="tab:red", linewidth=1)
    err_ax.set_ylabel("logprob_mult_err − 1")
    err_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    err_ax.set_ylim(bottom=0)
    err_ax.grid(alpha=0.3)
    err_ax.set_xlabel("step")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path
