"""What a GRPO run shows on the terminal (the logging rank's stderr): one progress bar, a
summary line every ``run.log_every`` steps, and a few sample completions per evaluation.
Everything else (per-refit telemetry, library INFO lines) goes to ``metrics.jsonl`` and the log
files, not here."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping
from typing import Any

from tqdm import tqdm

from mcore_refit.grpo.evaluation import SAMPLES_KEY

EVAL_REWARD = "eval/reward_mean"


class Console:
    """The bar shows the latest reward, eval reward, ``mult_err`` and refit time; the summary
    line adds the mean reward over the last ``log_every`` steps and the step time. Does nothing
    unless ``enabled``."""

    def __init__(self, *, total: int, initial: int, log_every: int, enabled: bool) -> None:
        self._log_every = log_every
        self._total = total
        self._rewards: list[float] = []
        self._eval_reward: float | None = None
        self._enabled = enabled
        self._bar = None
        if enabled:
            self._bar = tqdm(total=total, initial=initial, desc="grpo", unit="step",
                             dynamic_ncols=True, file=sys.stderr)

    def update(self, record: Mapping[str, Any]) -> None:
        """Show one step's record (keys of :mod:`mcore_refit.grpo.loop`'s records)."""
        if self._bar is None:
            return
        self._rewards.append(record["reward_mean"])
        if record.get(EVAL_REWARD) is not None:
            self._eval_reward = record[EVAL_REWARD]
        postfix = {"reward": f"{record['reward_mean']:.3f}"}
        if self._eval_reward is not None:
            postfix["eval"] = f"{self._eval_reward:.3f}"
        postfix["mult_err"] = f"{record['logprob_mult_err']:.7f}"
        postfix["refit"] = f"{record['refit_s'] * 1e3:.1f}ms"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)
        if self._log_every and record["step"] % self._log_every == 0:
            self._bar.write(self.summary_line(record), file=sys.stderr)
        for sample in record.get(SAMPLES_KEY, ()):
            self._bar.write(f"eval step {record['step']}: {sample['prompt']!r} -> "
                            f"{sample['completion']!r} (reward {sample['reward']:.3f})",
                            file=sys.stderr)

    def summary_line(self, record: Mapping[str, Any]) -> str:
        recent = self._rewards[-self._log_every:] if self._log_every else self._rewards[-1:]
        parts = [f"step {record['step']}/{self._total}",
                 f"reward {statistics.fmean(recent):.3f} (mean of last {len(recent)})"]
        if self._eval_reward is not None:
            parts.append(f"eval reward {self._eval_reward:.3f}")
        parts += [f"mult_err {record['logprob_mult_err']:.7f}",
                  f"refit {record['refit_s'] * 1e3:.1f} ms",
                  f"step {record['step_s']:.2f} s"]
        return " | ".join(parts)

    def close(self) -> None:
        """End the bar; :meth:`write` still works."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def write(self, line: str) -> None:
        """One line on the terminal, below the bar (only if ``enabled``)."""
        if self._enabled:
            tqdm.write(line, file=sys.stderr)
