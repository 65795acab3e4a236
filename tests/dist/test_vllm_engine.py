"""The vLLM engine in its engine process, against the embedded (Hugging Face) engine on the same
weights: seeded sampling, logprobs of the temperature-scaled distribution, greedy decoding, the
stop token, released weights, and start-up failures named with the model and its shape.

One vLLM engine process serves the module (its start costs ~10-30 s on CPU); the reference
engine runs in the test process.
"""

import re

import pytest
import torch

from mcore_refit.inference.engine import InferenceEngine, SamplingConfig
from mcore_refit.inference.process import EngineError, EngineProcess, EngineSpec
from mcore_refit.refit.config import TransportOptions
from mcore_refit.tiny import VLLM_SIZES, TinyModelSpec, write_tiny_checkpoint

PROMPTS = ["12+7=", "3+4=", "19+19=", "a"]  # different lengths
# fp32 on CPU: vLLM's and a transformers forward's logprobs differ by ~1e-6 (measured); a wrong
# temperature or a raw logprob is off by ~0.1 and more.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny",
                                 TinyModelSpec(num_layers=2, **VLLM_SIZES))


def vllm_spec(hf_path) -> EngineSpec:
    return EngineSpec(hf_path=str(hf_path), device="cpu", dtype="float32", seed=0,
                      transport=TransportOptions(), engine="vllm")


@pytest.fixture(scope="module")
def engine(checkpoint):
    with EngineProcess(vllm_spec(checkpoint), timeout_s=600.0) as process:
        yield process


@pytest.fixture(scope="module")
def reference(checkpoint):
    return InferenceEngine(str(checkpoint), device=torch.device("cpu"), dtype=torch.float32)


def generate(engine, prompts, *, num_samples, sampling, seed=None):
    from mcore_refit.inference.process import completions_from_json

    return completions_from_json(engine.call("generate", prompts=list(prompts),
                                             num_samples=num_samples, sampling=sampling,
                                             seed=seed))


def reference_logprobs(reference, completion, temperature):
    """The trainer's definition: log_softmax(logits / T) of each sampled token, one forward."""
    ids = torch.tensor([list(completion.prompt_ids) + list(completion.token_ids)])
    with torch.no_grad():
        logits = reference.model(input_ids=ids).logits[0].float()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    start = len(completion.prompt_ids)
    return torch.stack([log_probs[start + i - 1, token]
                        for i, token in enumerate(completion.token_ids)])


@pytest.mark.timeout(900)
def test_vllm_same_seed_same_completions(engine):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    first = generate(engine, PROMPTS, num_samples=4, sampling=sampling, seed=7)
    assert generate(engine, PROMPTS, num_samples=4, sampling=sampling, seed=7) == first
    other = generate(engine, PROMPTS, num_samples=4, sampling=sampling, seed=8)
    assert other != first
    # Each completion of a call has a seed of its own: a group's samples differ.
    assert len({c.token_ids for c in first[0]}) > 1


@pytest.mark.timeout(900)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_logprobs_match_the_hf_engine_on_the_same_weights(engine, reference, temperature):
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=6)
    groups = generate(engine, PROMPTS, num_samples=3, sampling=sampling, seed=1)
    worst = 0.0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for completion in group:
            assert list(completion.prompt_ids) == reference.tokenizer(
                prompt, add_special_tokens=False)["input_ids"]
            assert len(completion.token_ids) == len(completion.logprobs) == 6
            expected = reference_logprobs(reference, completion, temperature)
            worst = max(worst, (torch.tensor(completion.logprobs) - expected).abs().max().item())
    print(f"T={temperature}: max |vLLM logprob - HF logprob| = {worst:.2e}")
    assert worst <= LOGPROB_TOLERANCE


@pytest.mark.timeout(900)
def test_vllm_greedy_takes_what_the_hf_engine_takes(engine, reference):
    greedy = SamplingConfig(max_new_tokens=5, greedy=True)
    got = generate(engine, PROMPTS, num_samples=2, sampling=greedy)
    expected = reference.generate(PROMPTS, num_samples=2, sampling=greedy)
    assert [[c.token_ids for c in group] for group in got] == \
        [[c.token_ids for c in group] for group in expected]
    assert [[c.text for c in group] for group in got] == \
        [[c.text for c in group] for group in expected]


@pytest.mark.timeout(900)
def test_vllm_stops_at_the_stop_token_and_flags_the_budget(engine, reference):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)  # stops at EOS
    groups = generate(engine, PROMPTS, num_samples=2, sampling=sampling, seed=3)
    completions = [c for group in groups for c in group]
    tokenizer = reference.tokenizer
    for c in completions:  # ended by EOS (kept as the last id) or by the budget
        assert c.stopped == (c.token_ids[-1] == tokenizer.eos_token_id)
        assert c.stopped or len(c.token_ids) == 6
    # A stop token that one completion draws mid-way, not before (a random model also draws
    # ids beyond the tokenizer's vocabulary: those have no token to name).
    stop_id = next(token for c in completions for i, token in enumerate(c.token_ids)
                   if 1 <= i < 5 and token < len(tokenizer) and token not in c.token_ids[:i]
                   and token != tokenizer.eos_token_id)
    stopping = SamplingConfig(temperature=1.0, max_new_tokens=6,
                              stop_token=tokenizer.convert_ids_to_tokens(stop_id))
    again = [c for group in generate(engine, PROMPTS, num_samples=2, sampling=stopping, seed=3)
             for c in group]
    # The same seeds draw the same tokens up to the stop token: kept as the last id, cut from
    # the text; EOS no longer stops.
    for before, after in zip(completions, again, strict=True):
        if stop_id in before.token_ids:
            n = before.token_ids.index(stop_id) + 1
            assert after.stopped
            assert after.token_ids == before.token_ids[:n]
            assert after.logprobs == before.logprobs[:n]
            assert after.text == tokenizer.decode(list(before.token_ids[:n - 1]))
        else:
            assert after.token_ids[:len(before.token_ids)] == before.token_ids
            assert after.stopped == (after.token_ids[-1] == stop_id)
            assert after.stopped or len(after.token_ids) == 6
    assert sum(after.stopped for after in again) >= 1


@pytest.mark.timeout(900)
def test_vllm_refuses_to_generate_from_released_weights(engine):
    engine.call("release_memory")
    engine.call("reacquire_memory")
    with pytest.raises(EngineError, match="the engine's weights were released and no refit "
                                          "has loaded them since; refusing to generate"):
        generate(engine, PROMPTS, num_samples=1, sampling=SamplingConfig(max_new_tokens=2))


@pytest.mark.timeout(900)
def test_vllm_start_failures_name_the_model(tmp_path):
    with pytest.raises(EngineError, match=re.escape(
            f"VllmStartError: model.hf_path='{tmp_path}' has no config.json: not a Hugging "
            "Face checkpoint directory")):
        EngineProcess(vllm_spec(tmp_path), timeout_s=600.0)
    # Head size 16: vLLM's CPU attention refuses it at the first forward, which the engine runs
    # at start-up.
    narrow = write_tiny_checkpoint(tmp_path / "narrow",
                                   TinyModelSpec(num_layers=1, hidden_size=64))
    with pytest.raises(EngineError, match=re.escape(
            f"VllmStartError: vLLM's start-up forward failed on model.hf_path='{narrow}' "
            "(LlamaForCausalLM, 1 layers, hidden size 64, 4 heads of head size 16, 2 KV heads): "
            "RuntimeError: Unsupported CPU attention configuration: head_dim=16")):
        EngineProcess(vllm_spec(narrow), timeout_s=600.0)
