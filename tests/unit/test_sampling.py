"""The embedded engine's multi-token sampling on a tiny checkpoint: KV-cache logprobs against a
plain forward, stop token and budget, greedy decoding, top-p, the pad token."""

import pytest
import torch

from mcore_refit.inference.engine import (
    InferenceEngine,
    SamplingConfig,
    pad_token_id,
    top_p_filter,
)
from mcore_refit.tiny import TinyModelSpec, build_tokenizer, write_tiny_checkpoint

PROMPTS = ["12+7=", "3+4=", "19+19=", "a"]  # different lengths: left padding in the batch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("sampling") / "tiny",
                                 TinyModelSpec(num_layers=2))


def new_engine(checkpoint):
    return InferenceEngine(str(checkpoint), device=torch.device("cpu"), dtype=torch.float32,
                           seed=0)


@pytest.fixture(scope="module")
def engine(checkpoint):
    return new_engine(checkpoint)


def plain_logprobs(engine, prompt_ids, token_ids, temperature):
    """Log-probabilities of ``token_ids`` after ``prompt_ids``: one forward, no cache, no pad."""
    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    start = len(prompt_ids)
    return torch.stack([log_probs[start + i - 1, token] for i, token in enumerate(token_ids)])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kv_cache_logprobs_equal_one_forward_without_cache(checkpoint, temperature):
    # A stop token that the first row samples third: an engine with the same seed draws the same
    # tokens, so that row stops early while the others run on (mixed lengths in one batch).
    budget = SamplingConfig(temperature=temperature, max_new_tokens=6, stop_token="</s>")
    [[first, *_], *_] = new_engine(checkpoint).generate(PROMPTS, num_samples=3, sampling=budget)
    engine = new_engine(checkpoint)
    stop_token = engine.tokenizer.convert_ids_to_tokens(first.token_ids[2])
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=6, stop_token=stop_token)
    groups = engine.generate(PROMPTS, num_samples=3, sampling=sampling)
    assert groups[0][0].stopped and len(groups[0][0].token_ids) <= 3
    lengths = set()
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for completion in group:
            assert list(completion.prompt_ids) == engine.tokenizer(
                prompt, add_special_tokens=False)["input_ids"]
            expected = plain_logprobs(engine, completion.prompt_ids, completion.token_ids,
                                      temperature)
            got = torch.tensor(completion.logprobs)
            assert got.shape == expected.shape
            assert torch.allclose(got, expected, rtol=0.0, atol=1e-6), (got - expected).abs().max()
            lengths.add(len(completion.token_ids))
    assert len(lengths) > 1  # the batch mixed finished and running rows


def test_stop_token_and_budget_are_flagged(engine):
    greedy = SamplingConfig(max_new_tokens=5, greedy=True, stop_token="</s>")
    [[first]] = engine.generate(["12+7="], num_samples=1, sampling=greedy)
    assert len(first.token_ids) == 5 and not first.stopped  # the budget ended it
    assert first.text == engine.tokenizer.decode(list(first.token_ids))
    # Stop at the third greedy token: flagged, kept as the last token id, cut from the text.
    third = engine.tokenizer.convert_ids_to_tokens(first.token_ids[2])
    if third in engine.tokenizer.convert_ids_to_tokens(list(first.token_ids[:2])):
        pytest.skip("the greedy continuation repeats its third token earlier")
    stopping = SamplingConfig(max_new_tokens=5, greedy=True, stop_token=third)
    [[stopped]] = engine.generate(["12+7="], num_samples=1, sampling=stopping)
    assert stopped.stopped
    assert stopped.token_ids == first.token_ids[:3]
    assert stopped.logprobs == first.logprobs[:3]
    assert stopped.text == engine.tokenizer.decode(list(first.token_ids[:2]))


def test_greedy_takes_the_most_likely_token_every_step(engine):
    greedy = SamplingConfig(max_new_tokens=4, greedy=True, temperature=0.5)
    groups = engine.generate(PROMPTS, num_samples=2, sampling=greedy)
    for group in groups:
        first, second = group
        assert first == second  # deterministic
        ids = list(first.prompt_ids) + list(first.token_ids)
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([ids])).logits[0]
        start = len(first.prompt_ids)
        argmax = logits[start - 1:start - 1 + len(first.token_ids)].argmax(dim=-1)
        assert tuple(argmax.tolist()) == first.token_ids
        # Logprobs stay those of the temperature-scaled distribution.
        expected = plain_logprobs(engine, first.prompt_ids, first.token_ids, 0.5)
        assert torch.allclose(torch.tensor(first.logprobs), expected, rtol=0.0, atol=1e-6)


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3],
                          [0.25, 0.25, 0.25, 0.25]])
    kept = top_p_filter(probs, 0.8)
    # Row 0: 0.5 + 0.3 reaches 0.8; row 1: ties, any three of four reach 0.75 < 0.8, so all four.
    assert torch.equal(kept[0], torch.tensor([0.0, 0.5, 0.0, 0.3]))
    assert torch.equal(kept[1], probs[1])
    assert torch.equal(top_p_filter(probs, 0.81)[0], torch.tensor([0.0, 0.5, 0.15, 0.3]))
    assert torch.equal(top_p_filter(probs, 0.5)[0], torch.tensor([0.0, 0.5, 0.0, 0.0]))
    assert torch.equal(top_p_filter(probs, 0.01)[0], torch.tensor([0.0, 0.5, 0.0, 0.0]))
    assert top_p_filter(probs, 1.0) is probs


def test_sampling_with_top_p_draws_only_from_the_nucleus(engine):
    sampling = SamplingConfig(max_new_tokens=1, top_p=0.3, temperature=2.0)
    [group] = engine.generate(["12+7="], num_samples=64, sampling=sampling)
    ids = list(group[0].prompt_ids)
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    nucleus = top_p_filter(torch.softmax(logits / 2.0, dim=-1).unsqueeze(0), 0.3)[0] > 0
    drawn = {c.token_ids[0] for c in group}
    assert all(nucleus[token] for token in drawn)
    assert int(nucleus.sum()) < logits.numel()  # the filter did cut something


def test_a_tokenizer_without_pad_token_pads_with_eos():
    tokenizer = build_tokenizer()
    assert pad_token_id(tokenizer, where="x") == tokenizer.pad_token_id
    tokenizer.pad_token = None
    assert pad_token_id(tokenizer, where="x") == tokenizer.eos_token_id
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="the tokenizer in x has neither a pad token nor an eos"):
        pad_token_id(tokenizer, where="x")


def test_a_prompt_that_leaves_no_room_for_the_completion_is_refused(engine):
    prompt = "1+" * 126 + "1="  # 254 characters, one token each, of 256 positions
    with pytest.raises(ValueError) as error:
        engine.generate(["1+1=", prompt], num_samples=1, sampling=SamplingConfig(max_new_tokens=4))
    assert str(error.value) == (
        f"a prompt ({prompt[:60]!r}…) is 254 tokens; with inference.sampling.max_new_tokens=4 "
        "it needs 258 positions, more than the model's 256 (max_position_embeddings): shorten "
        "the prompts or lower inference.sampling.max_new_tokens")
    engine.generate([prompt], num_samples=1, sampling=SamplingConfig(max_new_tokens=2))
