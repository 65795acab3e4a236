"""GRPO math: advantages, the clipped loss and its gradient, KL, logprob agreement."""

import math
import re

import pytest
import torch

from mcore_refit.grpo.loss import GRPOLoss, group_advantages, logprob_mult_err


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    advantages = group_advantages(rewards, group_size=4)
    assert torch.allclose(advantages[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(advantages[4:], torch.zeros(4))
    centred = group_advantages(rewards, group_size=4, normalize_std=False)
    assert torch.equal(centred[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match=re.escape(
            "rewards of shape (8,) do not split into groups of 3")):
        group_advantages(rewards, group_size=3)


def micro_batch(old, advantages, ref=None):
    batch = {"loss_mask": torch.tensor([[0.0, 1.0, 1.0]]), "old_logprobs": old,
             "advantages": torch.tensor([advantages])}
    if ref is not None:
        batch["ref_logprobs"] = ref
    return batch


def test_on_policy_loss_is_reinforce_with_exact_gradient():
    logprobs = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    out = GRPOLoss()(logprobs, micro_batch(logprobs.detach().clone(), 2.0))
    assert out.num_tokens.item() == 2
    assert out.loss_sum.item() == pytest.approx(-4.0)  # −ρA summed over 2 tokens, ρ = 1
    out.loss_sum.backward()
    assert torch.equal(logprobs.grad, torch.tensor([[0.0, -2.0, -2.0]]))
    assert out.metrics["clip_fraction"].item() == 0.0
    assert out.metrics["ratio"].item() == pytest.approx(2.0)  # summed over 2 tokens


def test_clipped_tokens_get_no_gradient():
    old = torch.tensor([[0.0, -1.0, -1.0]])
    logprobs = torch.tensor([[0.0, -1.0 + math.log(1.5), -1.0]], requires_grad=True)
    out = GRPOLoss(clip_low=0.2, clip_high=0.2)(logprobs, micro_batch(old, 1.0))
    out.loss_sum.backward()
    assert logprobs.grad[0, 1].item() == 0.0  # ratio 1.5 > 1.2 with A > 0: clipped
    assert logprobs.grad[0, 2].item() == -1.0
    assert out.metrics["clip_fraction"].item() == 1.0
    assert out.loss_sum.item() == pytest.approx(-(1.2 + 1.0))


def test_kl_term_and_required_fields():
    logprobs = torch.tensor([[0.0, -1.0, -2.0]])
    ref = torch.tensor([[0.0, -1.0, -2.0 + 0.5]])
    loss = GRPOLoss(kl_coef=0.1)
    assert loss.required_fields == ("advantages", "old_logprobs", "ref_logprobs")
    out = loss(logprobs, micro_batch(logprobs, 0.0, ref))
    expected_kl = math.exp(0.5) - 0.5 - 1.0
    assert out.metrics["kl"].item() == pytest.approx(expected_kl)
    assert out.loss_sum.item() == pytest.approx(0.1 * expected_kl)
    assert GRPOLoss().required_fields == ("advantages", "old_logprobs")


@pytest.mark.parametrize("kwargs, message", [
    ({"clip_low": 1.0}, "grpo.clip_low must be in [0, 1), got 1.0"),
    ({"clip_high": -0.1}, "grpo.clip_high must be ≥ 0, got -0.1"),
    ({"kl_coef": -1.0}, "grpo.kl_coef must be ≥ 0, got -1.0"),
])
def test_bad_loss_settings(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GRPOLoss(**kwargs)


def test_logprob_mult_err():
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    a = torch.tensor([[5.0, -1.0, -2.0]])
    assert logprob_mult_err(a, a.clone(), mask) == 1.0
    b = torch.tensor([[0.0, -1.1, -2.0]])
    assert logprob_mult_err(a, b, mask) == pytest.approx((math.exp(0.1) + 1.0) / 2)
    with pytest.raises(ValueError, match="needs at least one masked-in token"):
        logprob_mult_err(a, b, torch.zeros(1, 3))
