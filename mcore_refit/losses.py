"""Training losses over per-token log-probabilities, normalised over the global batch.

A loss function sees one micro-batch at a time: the policy's per-token log-probabilities
``logprobs [rows, seq]`` (token-aligned: ``logprobs[:, t]`` is log p(token t | tokens before t),
0 at position 0 and at padding) and the micro-batch dict, which holds ``loss_mask [rows, seq]``
(1.0 where a token counts) and the batch's extra fields gathered for its rows (per-token fields
``[rows, seq]``, per-sequence fields ``[rows]``).

It returns a :class:`LossOutput`: the *sum* of its per-token losses and the number of tokens
counted. The policy runs Megatron with ``calculate_per_token_loss=True``, which adds the token
counts over all micro-batches and data-parallel ranks and divides the gradients by that total, so
the loss is a mean over every counted token of the global batch, the same for any layout or
micro-batch split. Metrics are per-token sums too and are reported divided by the same total.
"""

from __future__ import annotations

import abc
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import torch

from mcore_refit.pipeline import MicroBatch


@dataclass(frozen=True)
class LossOutput:
    """What a loss function returns for one micro-batch.

    ``loss_sum``: scalar, differentiable, the sum of per-token losses over the counted tokens.
    ``num_tokens``: integer scalar, the tokens counted.
    ``metrics``: per-token sums (scalars, any grad is dropped), keyed as the function's
    ``metric_names``.
    """

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    metrics: dict[str, torch.Tensor]


class LossFunction(Protocol):
    """A per-micro-batch loss.

    ``metric_names`` lists the keys of ``LossOutput.metrics`` and ``required_fields`` the batch
    fields it reads. Both must be known up front: pipeline stages without the loss need the names
    to take part in the metric reduction, and a missing field must fail on every rank before the
    pipeline starts, not on the last stage alone.
    """

    metric_names: tuple[str, ...]
    required_fields: tuple[str, ...]

    def __call__(self, logprobs: torch.Tensor, micro_batch: MicroBatch) -> LossOutput:
        ...


# Metric names the policy itself reports next to a loss function's metrics.
RESERVED_METRICS = ("loss", "num_tokens")


def check_loss_inputs(loss_fn: LossFunction, *, batch_fields: Collection[str]) -> None:
    """Raise ``ValueError`` if ``loss_fn`` cannot run on a batch with ``batch_fields``.

    Called on every rank before the pipeline starts, so that a bad input fails everywhere at once.
    """
    name = type(loss_fn).__name__
    for attribute in ("metric_names", "required_fields"):
        value = getattr(loss_fn, attribute, None)
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"loss function {name} must declare {attribute} as a tuple of str, "
                             f"got {value!r}")
    clashes = sorted(set(loss_fn.metric_names) & set(RESERVED_METRICS))
    if clashes:
        raise ValueError(f"{name}.metric_names may not use the reserved names {clashes}")
    missing = [key for key in loss_fn.required_fields if key not in batch_fields]
    if missing:
        raise ValueError(f"{name} needs the batch fields {missing}; the batch has "
                         f"{sorted(batch_fields)}")


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (fp32), without letting padding NaNs through."""
    return torch.where(mask > 0, values.float() * mask.float(), 0.0).sum()


def count_tokens(mask: torch.Tensor) -> torch.Tensor:
    """The number of set mask entries as the integer scalar Megatron's schedule accumulates."""
    return (mask > 0).sum().to(torch.int)


class CrossEntropyLoss:
    """Token-level negative log-likelihood (supervised fine-tuning, and the parity tests)."""

    metric_names = ("nll",)
    required_fields = ()

    def __call__(self, logprobs: torch.Tensor, micro_batch: MicroBatch) -> LossOutput:
        mask = micro_batch["loss_mask"]
        loss_sum = -masked_sum(logprobs, mask)
        return LossOutput(loss_sum=loss_sum, num_tokens=count_tokens(mask),
                          metrics={"nll": loss_sum.detach().clone()})


@dataclass(frozen=True)
class PolicyGradientInputs:
    """Token-aligned ``[rows, seq]`` tensors a policy-gradient loss works on.

    ``advantages`` is broadcastable to ``[rows, seq]`` (per-sequence advantages are
    ``[rows, 1]``). ``old_logprobs`` (the sampling policy) and ``ref_logprobs`` (the reference
    model) are present when the batch carries them.
    """

    logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None


class PolicyGradientLoss(abc.ABC):
    """Base class of policy-gradient losses (GRPO and friends).

    It reads the batch fields ``advantages`` (per sequence or per token), and when present
    ``old_logprobs`` and ``ref_logprobs`` (per token, token-aligned like the policy's), and sums
    the subclass's per-token loss and metrics over ``loss_mask``. Subclasses implement
    :meth:`per_token_loss` and set ``metric_names``.
    """

    metric_names: tuple[str, ...] = ()
    advantages_key = "advantages"
    old_logprobs_key = "old_logprobs"
    ref_logprobs_key = "ref_logprobs"

    @property
    def required_fields(self) -> tuple[str, ...]:
        return (self.advantages_key,)

    @abc.abstractmethod
    def per_token_loss(self, inputs: PolicyGradientInputs
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss ``[rows, seq]`` and per-token metric values keyed by ``metric_names``."""

    def __call__(self, logprobs: torch.Tensor, micro_batch: MicroBatch) -> LossOutput:
        inputs = self.inputs(logprobs, micro_batch)
        per_token, per_token_metrics = self.per_token_loss(inputs)
        if set(per_token_metrics) != set(self.metric_names):
            raise ValueError(f"{type(self).__name__}.per_token_loss returned metrics "
                             f"{sorted(per_token_metrics)}, metric_names is {self.metric_names}")
        metrics = {name: masked_sum(value.detach(), inputs.mask)
                   for name, value in per_token_metrics.items()}
        return LossOutput(loss_sum=masked_sum(per_token, inputs.mask),
                          num_tokens=count_tokens(inputs.mask), metrics=metrics)

    def inputs(self, logprobs: torch.Tensor, micro_batch: MicroBatch) -> PolicyGradientInputs:
        if self.advantages_key not in micro_batch:
            raise ValueError(f"{type(self).__name__} needs the batch field "
                             f"'{self.advantages_key}' (per sequence or per token)")
        advantages = micro_batch[self.advantages_key].float()
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        return PolicyGradientInputs(
            logprobs=logprobs,
            advantages=advantages,
            mask=micro_batch["loss_mask"],
            old_logprobs=micro_batch.get(self.old_logprobs_key),
            ref_logprobs=micro_batch.get(self.ref_logprobs_key),
        )


class VanillaPolicyGradientLoss(PolicyGradientLoss):
    """REINFORCE: ``−advantage · logprob`` per token; the simplest use of the interface."""

    metric_names = ("advantage",)

    def per_token_loss(self, inputs: PolicyGradientInputs
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        advantages = inputs.advantages.expand_as(inputs.logprobs)
        return -advantages * inputs.logprobs, {"advantage": advantages}
