"""Rollouts → the trainer's batch: token rows, response mask, advantages, sampler logprobs.

Everything is token-aligned (column ``t`` belongs to token ``t``), as the policy expects: the
response mask is 1 on completion tokens, and the sampler's log-probability of completion token
``t`` sits in column ``t`` of ``inference_logprobs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mcore_refit.inference.engine import Completion
from mcore_refit.policy.batch import SequenceBatch


@dataclass(frozen=True)
class RolloutBatch:
    """One step's rollouts as a policy batch, plus what the metrics need."""

    batch: SequenceBatch
    inference_logprobs: torch.Tensor  # [num_sequences, max_len], token-aligned
    response_mask: torch.Tensor  # [num_sequences, max_len]


def build_rollout_batch(groups: Sequence[Sequence[Completion]], rewards: torch.Tensor,
                        advantages: torch.Tensor, *, pad_token_id: int) -> RolloutBatch:
    """Flatten ``groups`` (one list of completions per prompt) into a :class:`RolloutBatch`.

    ``rewards`` and ``advantages`` are ``[num_sequences]`` in the same flattened order. The batch
    carries ``advantages`` (per sequence) and ``inference_logprobs`` (per token) as fields.
    """
    completions = [completion for group in groups for completion in group]
    num_sequences = len(completions)
    if rewards.shape != (num_sequences,) or advantages.shape != (num_sequences,):
        raise ValueError(f"{num_sequences} completions but rewards {tuple(rewards.shape)} and "
                         f"advantages {tuple(advantages.shape)}")
    for index, completion in enumerate(completions):
        if not completion.token_ids:
            raise ValueError(f"completion {index} is empty: every sample needs at least one token")
    lengths = [len(c.prompt_ids) + len(c.token_ids) for c in completions]
    max_len = max(lengths)
    tokens = torch.full((num_sequences, max_len), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((num_sequences, max_len), dtype=torch.float32)
    inference_logprobs = torch.zeros((num_sequences, max_len), dtype=torch.float32)
    for row, completion in enumerate(completions):
        start, end = len(completion.prompt_ids), lengths[row]
        tokens[row, :start] = torch.tensor(completion.prompt_ids)
        tokens[row, start:end] = torch.tensor(completion.token_ids)
        response_mask[row, start:end] = 1.0
        inference_logprobs[row, start:end] = torch.tensor(completion.logprobs)
    batch = SequenceBatch(
        tokens=tokens,
        lengths=torch.tensor(lengths),
        loss_mask=response_mask,
        fields={"advantages": advantages.float(), "inference_logprobs": inference_logprobs},
    )
    return RolloutBatch(batch=batch, inference_logprobs=inference_logprobs,
                        response_mask=response_mask)


def with_fields(batch: SequenceBatch, **fields: torch.Tensor) -> SequenceBatch:
    """``batch`` with extra loss fields added (e.g. ``old_logprobs``, ``ref_logprobs``)."""
    return SequenceBatch(tokens=batch.tokens, lengths=batch.lengths, loss_mask=batch.loss_mask,
                         fields={**batch.fields, **fields})
