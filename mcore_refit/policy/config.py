"""Configuration of the policy worker: optimizer, learning-rate schedule, micro-batch packing.

Frozen keyword-only dataclasses in the style of :mod:`mcore_refit.config`; build them from YAML
with :func:`mcore_refit.config.from_dict` / :func:`mcore_refit.config.load_config`. Errors name the
dotted key (``optimizer.lr``, ``packing.max_tokens_per_micro_batch``, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from mcore_refit.config import ConfigError

LrSchedule = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Adam(W) through Megatron's optimizer, with fp32 master weights for bf16 models.

    The learning rate of step k (0-based) follows Megatron's ``OptimizerParamScheduler``: linear
    warmup from ``lr_warmup_init`` (at k = 0) to ``lr`` (at k = ``lr_warmup_steps``), then
    ``lr_schedule``: constant ``lr``, or a linear/cosine decay reaching ``min_lr`` at
    ``lr_decay_steps`` and staying there.
    """

    lr: float = 1e-6
    min_lr: float = 0.0
    lr_schedule: LrSchedule = "constant"
    lr_warmup_steps: int = 0
    lr_warmup_init: float = 0.0
    # Required for "linear" and "cosine"; must exceed lr_warmup_steps.
    lr_decay_steps: int | None = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    # Largest global gradient norm; gradients above it are scaled down. None: no clipping (the
    # norm is still measured and reported).
    clip_grad: float | None = 1.0
    # Shard optimizer state (and fp32 master weights) over data-parallel ranks.
    use_distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        _require(self.lr > 0 and math.isfinite(self.lr), "lr", self.lr,
                 "a positive number")
        _require(0 <= self.min_lr <= self.lr, "min_lr", self.min_lr,
                 f"between 0 and `lr`={self.lr}")
        _require(self.lr_warmup_steps >= 0, "lr_warmup_steps", self.lr_warmup_steps,
                 "a non-negative integer")
        _require(0 <= self.lr_warmup_init <= self.lr, "lr_warmup_init",
                 self.lr_warmup_init, f"between 0 and `lr`={self.lr}")
        if self.lr_schedule != "constant":
            if self.lr_decay_steps is None:
                raise ConfigError(f"`lr_decay_steps` is required when "
                                  f"`lr_schedule`='{self.lr_schedule}'")
            _require(self.lr_decay_steps > self.lr_warmup_steps, "lr_decay_steps",
                     self.lr_decay_steps,
                     f"greater than `lr_warmup_steps`={self.lr_warmup_steps}")
        elif self.lr_decay_steps is not None:
            raise ConfigError("`lr_decay_steps` has no effect with `lr_schedule`='constant'; "
                              "remove it or choose a decay")
        _require(self.weight_decay >= 0, "weight_decay", self.weight_decay,
                 "non-negative")
        for key in ("adam_beta1", "adam_beta2"):
            value = getattr(self, key)
            _require(0 <= value < 1, key, value, "in [0, 1)")
        _require(self.adam_eps > 0, "adam_eps", self.adam_eps, "positive")
        if self.clip_grad is not None:
            _require(self.clip_grad > 0 and math.isfinite(self.clip_grad), "clip_grad",
                     self.clip_grad, "a positive number, or null for no clipping")

    @property
    def scheduler_decay_steps(self) -> int:
        """``lr_decay_steps`` for Megatron's scheduler (it wants one even when constant)."""
        return self.lr_decay_steps if self.lr_decay_steps is not None else self.lr_warmup_steps + 1


@dataclass(frozen=True, kw_only=True)
class PackingConfig:
    """How a batch of sequences becomes micro-batches (see :mod:`mcore_refit.policy.packing`).

    Each micro-batch is one bin of sequences, one sequence per row, right-padded; all micro-batches
    of one pass are padded to one shape (Megatron's pipeline schedule needs a fixed shape).
    """

    # Token budget of one micro-batch (sum of its sequences' lengths). None: no budget, as few
    # micro-batches as the count rules below allow.
    max_tokens_per_micro_batch: int | None = None
    # Least number of micro-batches over all data-parallel ranks, and what the count must be a
    # multiple of. None: dp_size, or dp_size × pp_size with pipeline parallelism.
    min_bin_count: int | None = None
    bin_count_multiple: int | None = None
    # Round the padded sequence length up to a multiple of this (e.g. 8 or 64 for GPU kernels);
    # with sequence parallelism it is also rounded to a multiple of the tensor-parallel size.
    pad_to_multiple: int = 1

    def __post_init__(self) -> None:
        for key in ("max_tokens_per_micro_batch", "min_bin_count", "bin_count_multiple"):
            value = getattr(self, key)
            if value is not None:
                _require(value >= 1, key, value, "a positive integer or null")
        _require(self.pad_to_multiple >= 1, "pad_to_multiple", self.pad_to_multiple,
                 "a positive integer")


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """The policy worker: optimizer, packing, sampling temperature, reference model."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    # Logits are divided by this before the log-softmax, in training and in logprobs; set it to
    # the inference sampler's temperature so both sides score the same distribution.
    temperature: float = 1.0
    # Keep a host copy of the initial weights for reference logprobs (KL penalties).
    reference_model: bool = True

    def __post_init__(self) -> None:
        _require(self.temperature > 0 and math.isfinite(self.temperature), "temperature",
                 self.temperature, "a positive number")


def _require(ok: bool, key: str, value, what: str) -> None:
    """``key`` is relative to the section that checks it."""
    if not ok:
        raise ConfigError(f"`{key}` must be {what}, got {value!r}")
