"""Batches of variable-length sequences and the micro-batches the pipeline schedule runs.

A :class:`SequenceBatch` is what callers hand the policy: right-padded token rows with their
lengths, an optional loss mask and extra fields for the loss. :func:`build_micro_batches` turns
the bins of a :class:`~mcore_refit.policy.packing.PackingPlan` into micro-batch dicts;
:func:`scatter_rows` puts per-row results back into batch order.

Everything is token-aligned: column ``t`` of a per-token field belongs to token ``t``. The model
input is the whole row and its label at ``t`` is token ``t + 1``; the policy shifts the resulting
log-probabilities back so that ``logprobs[:, t]`` scores token ``t`` (0 at ``t = 0``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mcore_refit.pipeline import MicroBatch

# Keys the policy puts into every micro-batch; batch fields may not reuse them.
RESERVED_KEYS = ("tokens", "labels", "position_ids", "attention_mask", "valid_mask", "loss_mask")


@dataclass(frozen=True, kw_only=True)
class SequenceBatch:
    """Sequences for one train step or logprob pass; the same batch on every rank.

    ``tokens``: ``[num_sequences, max_len]`` integer token ids, right-padded (padding values are
    ignored). ``lengths``: ``[num_sequences]``, each in ``[1, max_len]``. ``loss_mask``: optional
    ``[num_sequences, max_len]``, nonzero where a token counts in the loss (e.g. response tokens);
    by default every token but the first counts (the first has no prediction), and padding never
    counts. ``fields``: extra inputs of the loss, per token ``[num_sequences, max_len]`` or per
    sequence ``[num_sequences]`` (e.g. ``advantages``, ``old_logprobs``, ``ref_logprobs``).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    loss_mask: torch.Tensor | None = None
    fields: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.dtype.is_floating_point:
            raise ValueError(f"tokens must be an integer [num_sequences, max_len] tensor, got "
                             f"{self.tokens.dtype} {tuple(self.tokens.shape)}")
        num_sequences, max_len = self.tokens.shape
        if num_sequences == 0:
            raise ValueError("a batch needs at least one sequence")
        if tuple(self.lengths.shape) != (num_sequences,):
            raise ValueError(f"lengths must have shape ({num_sequences},), "
                             f"got {tuple(self.lengths.shape)}")
        if self.lengths.numel() and (int(self.lengths.min()) < 1
                                     or int(self.lengths.max()) > max_len):
            raise ValueError(f"lengths must lie in [1, {max_len}], got "
                             f"[{int(self.lengths.min())}, {int(self.lengths.max())}]")
        if self.loss_mask is not None and self.loss_mask.shape != self.tokens.shape:
            raise ValueError(f"loss_mask must have the shape of tokens {tuple(self.tokens.shape)},"
                             f" got {tuple(self.loss_mask.shape)}")
        for name, value in self.fields.items():
            if name in RESERVED_KEYS:
                raise ValueError(f"batch field '{name}' clashes with a reserved micro-batch key "
                                 f"({', '.join(RESERVED_KEYS)})")
            if tuple(value.shape) not in ((num_sequences,), (num_sequences, max_len)):
                raise ValueError(
                    f"batch field '{name}' must have shape ({num_sequences},) or "
                    f"({num_sequences}, {max_len}), got {tuple(value.shape)}"
                )

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_len(self) -> int:
        return self.tokens.shape[1]

    def length_list(self) -> list[int]:
        return [int(length) for length in self.lengths.tolist()]


def build_micro_batches(batch: SequenceBatch, bins: Sequence[Sequence[int]], *,
                        pad_to_multiple: int, device: torch.device,
                        shape_bins: Sequence[Sequence[int]] | None = None) -> list[MicroBatch]:
    """One micro-batch per bin, one row per sequence, all padded to one ``[rows, seq]`` shape.

    ``rows`` is the largest bin and ``seq`` the longest sequence in any of ``shape_bins``
    (default: ``bins``), rounded up to ``pad_to_multiple``; rows without a sequence are all
    padding. Passing every data-parallel rank's bins as ``shape_bins`` gives every rank the same
    shape (megatron-core's allgather MoE token dispatcher gathers equal shapes over the
    expert-parallel ranks). Each micro-batch holds
    ``tokens``, ``labels``, ``position_ids``, ``valid_mask`` (1.0 at positions ``1 ≤ t < length``,
    the positions that have a log-probability), ``loss_mask`` (``valid_mask`` times the batch's
    mask) and the batch fields.
    """
    assert bins and all(bins), "every micro-batch needs at least one sequence"
    lengths = batch.lengths.cpu()
    shape_bins = shape_bins if shape_bins is not None else bins
    num_rows = max(len(b) for b in shape_bins)
    seq_len = max(int(lengths[list(b)].max()) for b in shape_bins)
    seq_len = -(-seq_len // pad_to_multiple) * pad_to_multiple
    positions = torch.arange(seq_len)
    micro_batches = []
    for bin_indices in bins:
        index = torch.tensor(list(bin_indices), dtype=torch.long)
        rows_lengths = torch.zeros(num_rows, dtype=torch.long)
        rows_lengths[: len(index)] = lengths[index]
        inside = positions.unsqueeze(0) < rows_lengths.unsqueeze(1)
        tokens = torch.where(inside, _rows(batch.tokens, index, num_rows, seq_len), 0).long()
        labels = torch.zeros_like(tokens)
        labels[:, :-1] = tokens[:, 1:]
        valid = inside & (positions.unsqueeze(0) >= 1)
        loss_mask = valid.float()
        if batch.loss_mask is not None:
            loss_mask = loss_mask * (_rows(batch.loss_mask, index, num_rows, seq_len) != 0)
        micro_batch = {
            "tokens": tokens,
            "labels": labels,
            "position_ids": positions.expand(num_rows, seq_len).clone(),
            "valid_mask": valid.float(),
            "loss_mask": loss_mask,
        }
        for name, value in batch.fields.items():
            if value.dim() == 1:
                micro_batch[name] = _rows(value.unsqueeze(1), index, num_rows, 1).squeeze(1)
            else:
                micro_batch[name] = _rows(value, index, num_rows, seq_len)
        micro_batches.append({key: value.to(device) for key, value in micro_batch.items()})
    return micro_batches


def scatter_rows(per_bin: Sequence[torch.Tensor], bins: Sequence[Sequence[int]], *,
                 out: torch.Tensor) -> torch.Tensor:
    """Write row ``r`` of ``per_bin[k]`` to ``out[bins[k][r]]`` (columns cut to ``out``'s width)."""
    width = out.shape[1]
    for values, bin_indices in zip(per_bin, bins, strict=True):
        index = torch.tensor(list(bin_indices), dtype=torch.long, device=out.device)
        columns = min(width, values.shape[1])
        out[index, :columns] = values[: len(index), :columns].to(out.dtype)
    return out


def _rows(source: torch.Tensor, index: torch.Tensor, num_rows: int, width: int) -> torch.Tensor:
    """``source[index]`` as ``[num_rows, width]``: extra rows and columns zero, wider ones cut."""
    out = torch.zeros((num_rows, width), dtype=source.dtype)
    columns = min(width, source.shape[1])
    out[: len(index), :columns] = source[index.to(source.device), :columns].cpu()
    return out
