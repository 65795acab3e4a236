"""Pure pieces of the rollout backends: shard order, failure sharing, JSON messages."""

import re

import pytest

from mcore_refit.generation import (
    _completion_to_json,
    _completions_from_reply,
    _interleave,
    _outcome,
    _results_or_raise,
)
from mcore_refit.inference.engine import Completion


def test_interleave_undoes_strided_sharding():
    prompts = list(range(7))
    shards = [prompts[rank::3] for rank in range(3)]
    assert _interleave(shards, 7) == prompts


def test_failures_become_one_error_naming_every_failed_rank():
    outcomes = [_outcome(lambda: 1), _outcome(lambda: 1 / 0), ("error", "OSError: gone")]
    with pytest.raises(RuntimeError, match=re.escape(
            "generate failed on trainer rank 1: ZeroDivisionError: division by zero; "
            "trainer rank 2: OSError: gone")):
        _results_or_raise(outcomes, "generate", who="trainer rank")
    assert _results_or_raise([("ok", 1), ("ok", 2)], "generate", who="rank") == [1, 2]


def test_completions_round_trip_through_json():
    completion = Completion(prompt_ids=(5, 6), token_ids=(7, 2), logprobs=(-0.5, -1.25),
                            text="3", stopped=True)
    reply = {"ok": [[_completion_to_json(completion)]]}
    assert _completions_from_reply(reply) == [[completion]]
    with pytest.raises(RuntimeError, match="inference rank 0 failed generate: ValueError: x"):
        _completions_from_reply({"error": "ValueError: x"})
