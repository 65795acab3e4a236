"""The sequence packer: bin counts, budgets, round-robin dealing, errors."""

from __future__ import annotations

import random

import pytest

from mcore_refit.policy.packing import pack_for_layout, pack_sequences


def _check_plan(plan, lengths, *, budget, dp_size, min_bins, multiple):
    placed = sorted(i for b in plan.bins for i in b)
    assert placed == list(range(len(lengths))), "every sequence exactly once"
    assert all(plan.bins), "no empty bin"
    assert plan.num_bins >= min_bins and plan.num_bins % multiple == 0
    assert plan.bin_tokens == tuple(sum(lengths[i] for i in b) for b in plan.bins)
    if budget is not None:
        assert max(plan.bin_tokens) <= budget
    assert list(plan.bin_tokens) == sorted(plan.bin_tokens, reverse=True)
    per_rank = [plan.bins_for_rank(r) for r in range(dp_size)]
    assert len({len(bins) for bins in per_rank}) == 1, "equal micro-batch counts per rank"
    assert sorted(b for bins in per_rank for b in bins) == sorted(plan.bins)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("dp_size,pp_size", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_random_inputs_honour_every_rule(seed, dp_size, pp_size):
    rng = random.Random(seed)
    multiple = dp_size * pp_size
    lengths = [rng.randint(1, 100) for _ in range(rng.randint(4 * multiple, 80))]
    budget = rng.choice([None, 100, 150, 400])
    min_bins = rng.choice([None, 1, multiple, 3 * multiple])
    plan = pack_sequences(lengths, max_tokens_per_bin=budget, dp_size=dp_size,
                          min_bin_count=min_bins, bin_count_multiple=multiple)
    _check_plan(plan, lengths, budget=budget, dp_size=dp_size,
                min_bins=min_bins if min_bins is not None else dp_size, multiple=multiple)


def test_first_fit_decreasing_fills_bins_to_the_budget():
    plan = pack_sequences([5, 4, 3, 3, 2, 2, 1], max_tokens_per_bin=10, dp_size=1)
    assert plan.bins == ((0, 1, 6), (2, 3, 4, 5))
    assert plan.bin_tokens == (10, 10)


def test_defaults_are_the_data_parallel_size():
    plan = pack_sequences([3, 3, 3, 3, 3], max_tokens_per_bin=None, dp_size=2)
    # No budget: one bin would do, but both ranks need a bin; 2 is a multiple of dp_size.
    assert plan.num_bins == 2
    assert plan.bins_for_rank(0) == (plan.bins[0],) and plan.bins_for_rank(1) == (plan.bins[1],)


def test_minimum_count_splits_the_heaviest_bins():
    plan = pack_sequences([8, 1, 1, 1, 1, 1, 1, 1, 1], max_tokens_per_bin=None, dp_size=1,
                          min_bin_count=3)
    assert plan.num_bins == 3
    assert plan.bins[0] == (0,)  # the long sequence ends alone
    assert sorted(plan.bin_tokens) == [4, 4, 8]


def test_count_rounded_up_to_the_multiple():
    plan = pack_sequences([10] * 9, max_tokens_per_bin=30, dp_size=2, bin_count_multiple=4)
    assert plan.num_bins == 4  # 3 bins fit the budget; 4 is the next multiple
    assert [len(plan.bins_for_rank(r)) for r in (0, 1)] == [2, 2]


def test_round_robin_deals_heaviest_first():
    # First fit gives [9], [7], [5, 3]; the fourth bin (a multiple of 2) comes from a split.
    plan = pack_sequences([9, 7, 5, 3], max_tokens_per_bin=9, dp_size=2)
    assert plan.bins == ((0,), (1,), (2,), (3,))
    assert plan.bins_for_rank(0) == ((0,), (2,))
    assert plan.bins_for_rank(1) == ((1,), (3,))


def test_fewer_sequences_than_required_bins_is_an_error():
    with pytest.raises(ValueError, match=(
            r"^3 sequences cannot fill 4 bins \(min_bin_count=4, bin_count_multiple=4, 1 needed "
            r"for the token budget None\); every bin needs at least one sequence: pass at least "
            r"4 sequences$")):
        pack_sequences([5, 5, 5], max_tokens_per_bin=None, dp_size=2, min_bin_count=4,
                       bin_count_multiple=4)


def test_sequence_over_the_budget_is_an_error():
    with pytest.raises(ValueError, match=(
            r"^sequence 1 has 65 tokens, more than max_tokens_per_bin=64; raise the budget or "
            r"truncate the sequence$")):
        pack_sequences([10, 65], max_tokens_per_bin=64, dp_size=1)


@pytest.mark.parametrize("kwargs,message", [
    (dict(lengths=[], max_tokens_per_bin=None, dp_size=1),
     "cannot pack an empty list of sequences"),
    (dict(lengths=[3, 0], max_tokens_per_bin=None, dp_size=1),
     "sequence 1 has length 0; lengths must be integers of at least 1"),
    (dict(lengths=[3], max_tokens_per_bin=0, dp_size=1),
     "max_tokens_per_bin must be a positive integer or None, got 0"),
    (dict(lengths=[3], max_tokens_per_bin=None, dp_size=0),
     "dp_size must be a positive integer, got 0"),
    (dict(lengths=[3, 3, 3], max_tokens_per_bin=None, dp_size=2, bin_count_multiple=3),
     "bin_count_multiple=3 must be a multiple of dp_size=2, or data-parallel ranks would get "
     "different numbers of bins"),
])
def test_bad_arguments_are_named(kwargs, message):
    lengths = kwargs.pop("lengths")
    with pytest.raises(ValueError) as error:
        pack_sequences(lengths, **kwargs)
    assert str(error.value) == message


def test_bins_for_a_rank_outside_the_group_is_an_error():
    plan = pack_sequences([1, 2], max_tokens_per_bin=None, dp_size=2)
    with pytest.raises(ValueError, match=r"^dp_rank=2 is outside \[0, 2\)$"):
        plan.bins_for_rank(2)


def test_plan_is_deterministic():
    rng = random.Random(7)
    lengths = [rng.randint(1, 50) for _ in range(40)]
    first = pack_sequences(lengths, max_tokens_per_bin=120, dp_size=2, bin_count_multiple=4)
    second = pack_sequences(list(lengths), max_tokens_per_bin=120, dp_size=2,
                            bin_count_multiple=4)
    assert first == second


@pytest.mark.parametrize("dp_size,pp_size,expected", [(1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 4),
                                                      (4, 2, 8)])
def test_layout_defaults_to_whole_micro_batch_groups(dp_size, pp_size, expected):
    plan = pack_for_layout([7] * 20, max_tokens_per_bin=None, dp_size=dp_size, pp_size=pp_size)
    assert plan.num_bins == expected
    assert all(len(plan.bins_for_rank(r)) == expected // dp_size for r in range(dp_size))


def test_layout_keeps_explicit_counts_that_fit():
    plan = pack_for_layout([7] * 20, max_tokens_per_bin=None, dp_size=2, pp_size=2,
                           min_bin_count=5, bin_count_multiple=8)
    assert plan.num_bins == 8


@pytest.mark.parametrize("dp_size,pp_size,message", [
    (2, 2, "bin_count_multiple=6 must be a multiple of 4 (data-parallel size 2 × pipeline size "
           "2)"),
    (4, 1, "bin_count_multiple=6 must be a multiple of 4 (data-parallel size 4)"),
])
def test_layout_rejects_a_multiple_that_splits_micro_batch_groups(dp_size, pp_size, message):
    with pytest.raises(ValueError) as error:
        pack_for_layout([7] * 20, max_tokens_per_bin=None, dp_size=dp_size, pp_size=pp_size,
                        bin_count_multiple=6)
    assert str(error.value) == message
