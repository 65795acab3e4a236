"""GRPO: group-normalised advantages, the clipped policy-gradient loss, logprob agreement.

Pure tensor code: the loop that samples, scores, trains and refits lives in the recipe layer.
"""

from __future__ import annotations

import torch

from mcore_refit.losses import PolicyGradientInputs, PolicyGradientLoss


def group_advantages(rewards: torch.Tensor, *, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Advantage of each sample relative to the other samples of its prompt.

    ``rewards`` is ``[num_prompts * group_size]`` with each prompt's samples contiguous. The
    advantage is ``(r − mean(group)) / (std(group) + eps)`` (population std; without
    ``normalize_std`` just ``r − mean``). A group whose rewards are all equal gets zeros.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of "
                         f"{group_size}")
    groups = rewards.float().view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centered.flatten()


class GRPOLoss(PolicyGradientLoss):
    """Clipped surrogate ``−min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A)`` plus ``β·KL(π‖π_ref)``.

    ``ρ = exp(logprob − old_logprob)`` per token, against the logprobs of the policy that sampled
    the tokens (batch field ``old_logprobs``; the inference engine's, or the trainer's recomputed
    ones). The KL term uses the non-negative k3 estimator ``exp(r) − r − 1`` with
    ``r = ref_logprob − logprob`` and needs ``ref_logprobs`` when ``kl_coef > 0``. Token-level
    aggregation: the policy divides the summed per-token loss by the global token count.
    """

    metric_names = ("pg_loss", "kl", "clip_fraction", "ratio")

    def __init__(self, *, clip_low: float = 0.2, clip_high: float = 0.2,
                 kl_coef: float = 0.0) -> None:
        if not 0.0 <= clip_low < 1.0:
            raise ValueError(f"grpo.clip_low must be in [0, 1), got {clip_low}")
        if clip_high < 0.0:
            raise ValueError(f"grpo.clip_high must be ≥ 0, got {clip_high}")
        if kl_coef < 0.0:
            raise ValueError(f"grpo.kl_coef must be ≥ 0, got {kl_coef}")
        self.clip_low, self.clip_high, self.kl_coef = clip_low, clip_high, kl_coef

    @property
    def required_fields(self) -> tuple[str, ...]:
        fields = (self.advantages_key, self.old_logprobs_key)
        return fields + (self.ref_logprobs_key,) if self.kl_coef > 0 else fields

    def per_token_loss(self, inputs: PolicyGradientInputs
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert inputs.old_logprobs is not None
        logprobs = inputs.logprobs.float()
        advantages = inputs.advantages.expand_as(logprobs)
        ratio = torch.exp(logprobs - inputs.old_logprobs.float())
        clipped = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        pg_loss = -torch.minimum(ratio * advantages, clipped * advantages)
        was_clipped = (ratio * advantages > clipped * advantages).float()
        if self.kl_coef > 0:
            assert inputs.ref_logprobs is not None
            log_ratio = inputs.ref_logprobs.float() - logprobs
            kl = torch.exp(log_ratio) - log_ratio - 1.0
        else:
            kl = torch.zeros_like(logprobs)
        loss = pg_loss + self.kl_coef * kl
        return loss, {"pg_loss": pg_loss, "kl": kl, "clip_fraction": was_clipped,
                      "ratio": ratio}


def logprob_mult_err(trainer_logprobs: torch.Tensor, inference_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> float:
    """Mean over masked tokens of ``exp(|Δlogprob|)``: 1.0 when both sides agree exactly.

    A refit that loaded wrong weights shows up here as values far above 1.
    """
    if trainer_logprobs.shape != inference_logprobs.shape or trainer_logprobs.shape != mask.shape:
        raise ValueError(f"shapes differ: trainer {tuple(trainer_logprobs.shape)}, inference "
                         f"{tuple(inference_logprobs.shape)}, mask {tuple(mask.shape)}")
    selected = mask > 0
    if not selected.any():
        raise ValueError("logprob_mult_err needs at least one masked-in token")
    delta = (trainer_logprobs.double() - inference_logprobs.double()).abs()
    return torch.exp(delta[selected]).mean().item()
