"""Policy config: YAML loading, defaults, and an error naming the key for every bad value."""

from __future__ import annotations

import dataclasses

import pytest

from mcore_refit.config import from_dict, load_config
from mcore_refit.policy.config import OptimizerConfig, PackingConfig, PolicyConfig


def test_defaults_are_valid():
    config = PolicyConfig()
    assert config.optimizer.clip_grad == 1.0
    assert config.optimizer.lr_schedule == "constant"
    assert config.packing == PackingConfig()
    assert config.temperature == 1.0 and config.reference_model is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.temperature = 2.0


def test_load_yaml_with_overrides(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(
        "optimizer:\n  lr: 3.0e-6\n  lr_schedule: cosine\n  lr_warmup_steps: 10\n"
        "  lr_decay_steps: 100\n  clip_grad: null\n"
        "packing:\n  max_tokens_per_micro_batch: 4096\n  pad_to_multiple: 64\n"
        "temperature: 0.7\n"
    )
    config = load_config(PolicyConfig, path, ["optimizer.use_distributed_optimizer=true",
                                              "packing.min_bin_count=8"])
    assert config.optimizer == OptimizerConfig(lr=3e-6, lr_schedule="cosine", lr_warmup_steps=10,
                                               lr_decay_steps=100, clip_grad=None,
                                               use_distributed_optimizer=True)
    assert config.packing == PackingConfig(max_tokens_per_micro_batch=4096, pad_to_multiple=64,
                                           min_bin_count=8)
    assert config.temperature == 0.7


def test_scheduler_needs_decay_steps_even_when_constant():
    assert OptimizerConfig(lr_warmup_steps=5).scheduler_decay_steps == 6
    assert OptimizerConfig(lr_schedule="linear", lr_decay_steps=50).scheduler_decay_steps == 50


@pytest.mark.parametrize("data, message", [
    ({"optimiser": {}},
     "unknown config key 'optimiser' (known keys: optimizer, packing, reference_model, "
     "temperature)"),
    ({"optimizer": {"learning_rate": 1e-5}},
     "unknown config key 'optimizer.learning_rate' (known keys: adam_beta1, adam_beta2, "
     "adam_eps, clip_grad, lr, lr_decay_steps, lr_schedule, lr_warmup_init, lr_warmup_steps, "
     "min_lr, use_distributed_optimizer, weight_decay)"),
    ({"optimizer": {"lr": 0}}, "optimizer.lr must be a positive number, got 0.0"),
    ({"optimizer": {"lr": "fast"}}, "config key 'optimizer.lr' must be a number, got 'fast'"),
    ({"optimizer": {"lr": 1e-5, "min_lr": 1e-4}},
     "optimizer.min_lr must be between 0 and optimizer.lr=1e-05, got 0.0001"),
    ({"optimizer": {"lr_schedule": "step"}},
     "config key 'optimizer.lr_schedule' must be one of 'constant', 'linear', 'cosine', "
     "got 'step'"),
    ({"optimizer": {"lr_schedule": "cosine"}},
     "optimizer.lr_decay_steps is required when optimizer.lr_schedule='cosine'"),
    ({"optimizer": {"lr_schedule": "linear", "lr_warmup_steps": 10, "lr_decay_steps": 10}},
     "optimizer.lr_decay_steps must be greater than "
     "optimizer.lr_warmup_steps=10, got 10"),
    ({"optimizer": {"lr_decay_steps": 10}},
     "optimizer.lr_decay_steps has no effect with optimizer.lr_schedule='constant'; remove it "
     "or choose a decay"),
    ({"optimizer": {"lr_warmup_steps": -1}},
     "optimizer.lr_warmup_steps must be a non-negative integer, got -1"),
    ({"optimizer": {"lr_warmup_init": 1.0}},
     "optimizer.lr_warmup_init must be between 0 and optimizer.lr=1e-06, got 1.0"),
    ({"optimizer": {"adam_beta2": 1.0}},
     "optimizer.adam_beta2 must be in [0, 1), got 1.0"),
    ({"optimizer": {"adam_eps": 0}}, "optimizer.adam_eps must be positive, got 0.0"),
    ({"optimizer": {"weight_decay": -0.1}},
     "optimizer.weight_decay must be non-negative, got -0.1"),
    ({"optimizer": {"clip_grad": 0}},
     "optimizer.clip_grad must be a positive number, or null for no clipping, "
     "got 0.0"),
    ({"optimizer": {"use_distributed_optimizer": "yes"}},
     "config key 'optimizer.use_distributed_optimizer' must be true or false, got 'yes'"),
    ({"packing": {"max_tokens_per_micro_batch": 0}},
     "packing.max_tokens_per_micro_batch must be a positive integer or null, "
     "got 0"),
    ({"packing": {"bin_count_multiple": 2.5}},
     "config key 'packing.bin_count_multiple' must be an integer, got 2.5"),
    ({"packing": {"pad_to_multiple": 0}},
     "packing.pad_to_multiple must be a positive integer, got 0"),
    ({"temperature": 0}, "temperature must be a positive number, got 0.0"),
    ({"temperature": float("inf")},
     "temperature must be a positive number, got inf"),
    ({"reference_model": 1}, "config key 'reference_model' must be true or false, got 1"),
])
def test_bad_values_name_the_key(data, message):
    with pytest.raises(ValueError) as error:
        from_dict(PolicyConfig, data)
    assert str(error.value) == message
