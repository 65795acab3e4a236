"""The GRPO job's ``run`` section: steps, seeds, outputs.

Apart from the rest of the job's configuration because it imports nothing heavy: the recipe reads
this section alone (:func:`mcore_refit.config.load_section`) to lock ``run.output_dir`` before
torch is imported, so a second run on a directory is refused in seconds.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal

from mcore_refit.config import ConfigError


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Optional Weights & Biases tracking (the ``wandb`` extra: ``pip install '.[wandb]'``)."""

    # Off while null; else the wandb project the run logs to.
    project: str | None = None
    mode: Literal["offline", "online"] = "offline"
    # The run's name in wandb; null lets wandb pick one.
    name: str | None = None

    def __post_init__(self) -> None:
        if self.project is not None:
            if not self.project:
                raise ConfigError("`project` must be a wandb project name or null")
            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("`project` is set but wandb is not installed: "
                                  "pip install 'mcore_refit[wandb]' (or set it to null)")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Steps, seeds, outputs."""

    steps: int = 20
    seed: int = 1234
    output_dir: str = "runs/grpo"
    # Save a checkpoint every this many steps (and at the end); 0 saves only at the end. A
    # crash loses at most this many steps (`--resume` continues from the latest checkpoint).
    checkpoint_every: int = 50
    # Keep the newest this many complete checkpoints (null: every one). With 2 or more, a latest
    # checkpoint whose files are damaged is passed over for the one before on `--resume`.
    keep_checkpoints: int | None = 2
    # Compare the engine's weights with the trainer's export after every refit (slow; tests).
    verify_refit: bool = False
    # Metrics go to output_dir/metrics.jsonl, and to these:
    tensorboard: bool = True
    # Score the `eval` set every this many steps (and after the last); 0: after the last only.
    eval_every: int = 0
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # A summary line on the terminal every this many steps (0: none; the bar stays).
    log_every: int = 10
    # Write output_dir/metrics.png (reward, refit time, mult_err per step) when the run ends.
    plot: bool = True
    # Seconds one call of a user's function (task.reward, eval.reward) may take: past it the
    # rank reports the function and its input, and exits; the job fails naming it. null: no
    # bound.
    callback_timeout_s: float | None = 60.0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"`steps` must be ≥ 1, got {self.steps}")
        if self.eval_every < 0:
            raise ConfigError(f"`eval_every` must be ≥ 0, got {self.eval_every}")
        if self.log_every < 0:
            raise ConfigError(f"`log_every` must be ≥ 0, got {self.log_every}")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("`tensorboard` is true but the tensorboard package (pinned in "
                              "requirements.txt) is not installed; install it or set it to false")
        if self.checkpoint_every < 0:
            raise ConfigError(f"`checkpoint_every` must be ≥ 0, got {self.checkpoint_every}")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ConfigError(f"`keep_checkpoints` must be ≥ 1 or null, got "
                              f"{self.keep_checkpoints}")
        if self.callback_timeout_s is not None and not self.callback_timeout_s > 0:
            raise ConfigError(f"`callback_timeout_s` must be > 0 or null, got "
                              f"{self.callback_timeout_s}")
