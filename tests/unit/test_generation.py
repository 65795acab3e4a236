"""Pure pieces of the rollout backends and the engine pipe: shard order, JSON forms."""

import json

from mcore_refit.grpo.rollouts import interleave
from mcore_refit.inference.engine import Completion, SamplingConfig
from mcore_refit.inference.process import EngineSpec, _plain
from mcore_refit.refit.config import TransportOptions


def test_interleave_undoes_strided_sharding():
    prompts = list(range(7))
    shards = [prompts[rank::3] for rank in range(3)]
    assert interleave(shards, 7) == prompts


def test_completions_and_sampling_round_trip_through_json():
    completion = Completion(prompt_ids=(5, 6), token_ids=(7, 2), logprobs=(-0.5, -1.25),
                            text="3", stopped=True)
    assert Completion.from_json(json.loads(json.dumps(completion.to_json()))) == completion
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=4, stop_token="</s>")
    assert SamplingConfig.from_json(json.loads(json.dumps(sampling.to_json()))) == sampling
    assert _plain({"sampling": sampling, "n": 2}) == {"sampling": sampling.to_json(), "n": 2}


def test_engine_spec_round_trips_through_json():
    spec = EngineSpec(hf_path="/ckpt", device="cuda:1", dtype="bfloat16", seed=3,
                      transport=TransportOptions(timeout_s=5.0, checksums=True))
    assert EngineSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
