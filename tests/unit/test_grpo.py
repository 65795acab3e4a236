"""GRPO math: advantages, the clipped loss and its gradient, KL, logprob agreement; rollouts of
mixed lengths as a training batch."""

import math
import re

import pytest
import torch

from mcore_refit.grpo.batch import build_rollout_batch, with_fields
from mcore_refit.grpo.loss import GRPOLoss, group_advantages, logprob_mult_err
from mcore_refit.inference.engine import Completion
from mcore_refit.policy.batch import build_micro_batches


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


def completion(prompt_len, token_ids, stopped):
    return Completion(prompt_ids=tuple(range(10, 10 + prompt_len)), token_ids=tuple(token_ids),
                      logprobs=tuple(-0.1 * (i + 1) for i in range(len(token_ids))), text="",
                      stopped=stopped)


def test_mixed_completion_lengths_train_on_exactly_the_completion_tokens():
    # Prompts of 3 and 5 tokens; completions that stopped after 1 and 3 tokens (the stop token
    # is their last id) and one the budget of 4 cut.
    groups = [[completion(3, [7, 2], True), completion(3, [7, 8, 9, 4], False)],
              [completion(5, [2], True), completion(5, [5, 6, 2], True)]]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    advantages = group_advantages(rewards, group_size=2)
    rollout = build_rollout_batch(groups, rewards, advantages, pad_token_id=0)
    expected = torch.zeros(4, 8)
    for row, (start, length) in enumerate([(3, 2), (3, 4), (5, 1), (5, 3)]):
        expected[row, start:start + length] = 1.0
    assert torch.equal(rollout.response_mask, expected)
    assert torch.equal(rollout.batch.lengths, torch.tensor([5, 7, 6, 8]))

    [micro_batch] = build_micro_batches(rollout.batch, [[0, 1, 2, 3]], pad_to_multiple=4,
                                        device=torch.device("cpu"))
    assert torch.equal(micro_batch["loss_mask"], expected)  # nothing after a stop, no padding
    logprobs = torch.full((4, 8), -1.0, requires_grad=True)
    batch = with_fields(rollout.batch, old_logprobs=logprobs.detach().clone())
    [micro_batch] = build_micro_batches(batch, [[0, 1, 2, 3]], pad_to_multiple=4,
                                        device=torch.device("cpu"))
    out = GRPOLoss()(logprobs, micro_batch)
    assert out.num_tokens.item() == 10
    out.loss_sum.backward()
    # On policy: d(loss)/d(logprob) = −advantage on every completion token, 0 elsewhere.
    assert torch.equal(logprobs.grad, -advantages.unsqueeze(1) * expected)


def test_logprob_mult_err_covers_every_completion_token():
    groups = [[completion(2, [4, 5, 6], True)], [completion(5, [4], False)]]
    rollout = build_rollout_batch(groups, torch.zeros(2), torch.zeros(2), pad_token_id=0)
    trainer = rollout.inference_logprobs.clone()
    assert logprob_mult_err(trainer, rollout.inference_logprobs, rollout.response_mask) == 1.0
    trainer[0, 4] += 0.5  # the stop token of the first completion: its last token
    expected = (3 + math.exp(0.5)) / 4  # four completion tokens in all
    assert logprob_mult_err(trainer, rollout.inference_logprobs,
                            rollout.response_mask) == pytest.approx(expected)
    trainer[0, 5] += 9.0  # padding after the stop: not a completion token
    assert logprob_mult_err(trainer, rollout.inference_logprobs,
                            rollout.response_mask) == pytest.approx(expected)
