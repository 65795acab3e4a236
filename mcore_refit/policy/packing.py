"""Sequence packing: group variable-length sequences into bins that become micro-batches.

Pure functions over sequence lengths; nothing here touches tensors or process groups.

A *bin* is a set of sequence indices whose token count fits a budget. Bins are dealt to
data-parallel ranks round-robin (after sorting by token count, so ranks get similar loads), and the
number of bins is a multiple of ``bin_count_multiple``: with pipeline parallelism the policy asks
for ``dp_size × pp_size``, so every data-parallel rank gets a whole number of micro-batch groups
(Megatron's interleaved schedule wants the micro-batch count to be a multiple of the pipeline
size, and data-parallel ranks must run the same number of micro-batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PackingPlan:
    """Bins of sequence indices, heaviest first, and how they are dealt to data-parallel ranks.

    Bin ``i`` goes to data-parallel rank ``i % dp_size``; within a bin indices are ascending.
    """

    bins: tuple[tuple[int, ...], ...]
    bin_tokens: tuple[int, ...]
    dp_size: int

    @property
    def num_bins(self) -> int:
        return len(self.bins)

    def bins_for_rank(self, dp_rank: int) -> tuple[tuple[int, ...], ...]:
        """The bins (micro-batches) of data-parallel rank ``dp_rank``, in order."""
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {self.dp_size})")
        return self.bins[dp_rank::self.dp_size]


def pack_sequences(lengths: Sequence[int], *, max_tokens_per_bin: int | None, dp_size: int,
                   min_bin_count: int | None = None,
                   bin_count_multiple: int | None = None) -> PackingPlan:
    """Pack sequences of ``lengths`` tokens into bins of at most ``max_tokens_per_bin`` tokens.

    First-fit decreasing gives the fewest bins the budget allows (``None``: no budget). The count
    is then raised to at least ``min_bin_count`` and to a multiple of ``bin_count_multiple`` (both
    default to ``dp_size``) by splitting the heaviest multi-sequence bin in two, which never
    breaks the budget. Raises ``ValueError`` if a sequence exceeds the budget or if there are
    fewer sequences than the bins required (a bin is never empty).
    """
    min_bin_count = min_bin_count if min_bin_count is not None else dp_size
    bin_count_multiple = bin_count_multiple if bin_count_multiple is not None else dp_size
    _check_arguments(lengths, max_tokens_per_bin=max_tokens_per_bin, dp_size=dp_size,
                     min_bin_count=min_bin_count, bin_count_multiple=bin_count_multiple)

    bins = _first_fit_decreasing(lengths, max_tokens_per_bin)
    required = max(len(bins), min_bin_count)
    required = -(-required // bin_count_multiple) * bin_count_multiple
    if required > len(lengths):
        raise ValueError(
            f"{len(lengths)} sequences cannot fill {required} bins (min_bin_count={min_bin_count}, "
            f"bin_count_multiple={bin_count_multiple}, {len(bins)} needed for the token budget "
            f"{max_tokens_per_bin}); every bin needs at least one sequence: pass at least "
            f"{required} sequences"
        )
    while len(bins) < required:
        _split_heaviest(bins, lengths)

    tokens = [sum(lengths[i] for i in b) for b in bins]
    # Heaviest first (ties: lowest first index) so round-robin dealing balances the ranks.
    order = sorted(range(len(bins)), key=lambda k: (-tokens[k], min(bins[k])))
    return PackingPlan(
        bins=tuple(tuple(sorted(bins[k])) for k in order),
        bin_tokens=tuple(tokens[k] for k in order),
        dp_size=dp_size,
    )


def pack_for_layout(lengths: Sequence[int], *, max_tokens_per_bin: int | None, dp_size: int,
                    pp_size: int, min_bin_count: int | None = None,
                    bin_count_multiple: int | None = None) -> PackingPlan:
    """:func:`pack_sequences` for a data-parallel × pipeline-parallel layout.

    With pipeline parallelism every data-parallel rank needs a whole number of micro-batch groups
    of ``pp_size``, so both counts default to ``dp_size × pp_size`` (``dp_size`` without), and an
    explicit ``bin_count_multiple`` must be a multiple of that.
    """
    required = dp_size * pp_size if pp_size > 1 else dp_size
    if bin_count_multiple is not None and bin_count_multiple % required != 0:
        layout = (f"data-parallel size {dp_size} × pipeline size {pp_size}" if pp_size > 1
                  else f"data-parallel size {dp_size}")
        raise ValueError(f"bin_count_multiple={bin_count_multiple} must be a multiple of "
                         f"{required} ({layout})")
    return pack_sequences(
        lengths,
        max_tokens_per_bin=max_tokens_per_bin,
        dp_size=dp_size,
        min_bin_count=min_bin_count if min_bin_count is not None else required,
        bin_count_multiple=bin_count_multiple if bin_count_multiple is not None else required,
    )


def _check_arguments(lengths: Sequence[int], *, max_tokens_per_bin: int | None, dp_size: int,
                     min_bin_count: int, bin_count_multiple: int) -> None:
    for name, value in (("dp_size", dp_size), ("min_bin_count", min_bin_count),
                        ("bin_count_multiple", bin_count_multiple)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if bin_count_multiple % dp_size != 0:
        raise ValueError(
            f"bin_count_multiple={bin_count_multiple} must be a multiple of dp_size={dp_size}, "
            "or data-parallel ranks would get different numbers of bins"
        )
    if max_tokens_per_bin is not None and (
            isinstance(max_tokens_per_bin, bool) or not isinstance(max_tokens_per_bin, int)
            or max_tokens_per_bin < 1):
        raise ValueError(f"max_tokens_per_bin must be a positive integer or None, "
                         f"got {max_tokens_per_bin!r}")
    if not lengths:
        raise ValueError("cannot pack an empty list of sequences")
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"sequence {index} has length {length!r}; lengths must be integers "
                             "of at least 1")
        if max_tokens_per_bin is not None and length > max_tokens_per_bin:
            raise ValueError(
                f"sequence {index} has {length} tokens, more than max_tokens_per_bin="
                f"{max_tokens_per_bin}; raise the budget or truncate the sequence"
            )


def _first_fit_decreasing(lengths: Sequence[int], capacity: int | None) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in order:
        for k, load in enumerate(loads):
            if capacity is None or load + lengths[index] <= capacity:
                bins[k].append(index)
                loads[k] += lengths[index]
                break
        else:
            bins.append([index])
            loads.append(lengths[index])
    return bins


def _split_heaviest(bins: list[list[int]], lengths: Sequence[int]) -> None:
    """Split the heaviest bin holding two or more sequences into two bins (in place)."""
    candidates = [k for k, b in enumerate(bins) if len(b) > 1]
    assert candidates, "the caller checked that there are enough sequences"
    k = max(candidates, key=lambda c: (sum(lengths[i] for i in bins[c]), -c))
    items = sorted(bins[k], key=lambda i: (-lengths[i], i))
    # Greedy balance: each item to the lighter half, longest first.
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for index in items:
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].append(index)
        loads[side] += lengths[index]
    bins[k] = halves[0]
    bins.append(halves[1])
