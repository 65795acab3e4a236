"""Megatron's optimizer and learning-rate scheduler for a chunk list."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mcore_refit.model import ModelChunks
from mcore_refit.numerics import check_finite
from mcore_refit.policy.config import OptimizerConfig


def build_optimizer(model: ModelChunks, config: OptimizerConfig):
    """Megatron's (chained) Adam optimizer over every chunk of ``model``.

    bf16 models get fp32 master weights; with ``use_distributed_optimizer`` the state is sharded
    over data-parallel ranks (the chunks must have been DDP-wrapped with the same setting).
    """
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    dtype = model.model_config.dtype
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"model.dtype={dtype!r}: the policy trains float32 or bfloat16 models "
                         "(float16 would need loss scaling, which is not wired up)")
    megatron_config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        min_lr=config.min_lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_eps=config.adam_eps,
        # Megatron's ChainedOptimizer measures the norm regardless; 0.0 switches clipping off.
        clip_grad=config.clip_grad if config.clip_grad is not None else 0.0,
        bf16=dtype == "bfloat16",
        fp16=False,
        params_dtype=model.model_config.torch_dtype,
        use_distributed_optimizer=config.use_distributed_optimizer,
    )
    return get_megatron_optimizer(megatron_config, model.chunks)


def build_scheduler(optimizer, config: OptimizerConfig):
    """Megatron's ``OptimizerParamScheduler`` for ``config``; it has set the lr of step 0."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=config.lr_warmup_init if config.lr_warmup_steps > 0 else config.lr,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_steps,
        lr_decay_steps=config.scheduler_decay_steps,
        lr_decay_style=config.lr_schedule,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        # A loaded checkpoint's schedule wins over the config (resuming continues its schedule).
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )


def step_if_finite(optimizer) -> tuple[bool, float]:
    """``optimizer.step()`` — ``(update_successful, grad_norm)`` — unless the global gradient norm
    is NaN or infinite: then :class:`~mcore_refit.numerics.NonFiniteError` before any parameter
    or optimizer state changes.

    ``ChainedOptimizer.step`` (what :func:`build_optimizer` returns) measures the norm between
    preparing the gradients and clipping them (megatron-core 0.19.2, optimizer.py:1866); the
    check runs on the value it measures there, so it adds no pass over the gradients and no
    device sync. The norm is all-reduced over every model-parallel and data-parallel rank, so
    every rank raises.
    """
    assert hasattr(optimizer, "chained_optimizers"), "expected Megatron's ChainedOptimizer"
    measure = optimizer.get_grad_norm

    def measure_and_check() -> float:
        norm = measure()
        check_finite("gradient norm", float(norm))
        return norm

    optimizer.get_grad_norm = measure_and_check
    try:
        update_successful, grad_norm, _ = optimizer.step()
    finally:
        del optimizer.get_grad_norm  # the class's method again
    return bool(update_successful), grad_norm


def current_lr(optimizer) -> float:
    """The learning rate the next optimizer step uses."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    lr = get_canonical_lr_for_logging(optimizer.param_groups)
    assert lr is not None, "the optimizer has no default parameter group"
    return float(lr)


def inner_optimizers(optimizer) -> list:
    """The Megatron optimizers inside a ``ChainedOptimizer`` (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_state_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Every tensor the optimizers own: master parameters and per-parameter state (Adam moments).

    Model parameters appear here too when the optimizer updates them directly (fp32 without the
    distributed optimizer); callers deduplicate by storage.
    """
    for megatron_optimizer in inner_optimizers(optimizer):
        torch_optimizer = getattr(megatron_optimizer, "optimizer", None)
        if torch_optimizer is None:
            continue
        for group in torch_optimizer.param_groups:
            yield from group["params"]
        for state in torch_optimizer.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))
