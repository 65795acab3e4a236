"""The embedded inference engine: a Hugging Face causal LM that samples and scores rollouts.

It generates with a KV cache, temperature and top-p (or greedily, for evaluation), a stop token and
a token budget, and returns the sampled token ids with their log-probabilities and whether the stop
token or the budget ended each completion. Weights arrive only through
:meth:`InferenceEngine.load_weights` (the refit engine's target). In colocated mode the engine
can hand its weight memory back while the trainer trains (:meth:`release_memory`) and take it again
before the next refit (:meth:`reacquire_memory`); it refuses to generate from weights that no
refit has filled since.

Log-probabilities are those of the temperature-scaled distribution ``log_softmax(logits / T)``
before top-p truncation — the same quantity the trainer computes — so both sides can be compared
token by token (``logprob_mult_err``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from mcore_refit.config import ConfigError
from mcore_refit.hf_experts import loading_options
from mcore_refit.logs import output_to_log
from mcore_refit.refit import HFModelEngine


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How completions are sampled."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    # Token that ends a completion; None means the tokenizer's end-of-sequence token.
    stop_token: str | None = None
    # Take the most likely token at every step (evaluation); logprobs stay those at temperature.
    greedy: bool = False

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"`temperature` must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"`top_p` must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"`max_new_tokens` must be ≥ 1, got {self.max_new_tokens}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> SamplingConfig:
        return cls(**data)


@dataclass(frozen=True)
class Completion:
    """One sampled completion: token ids, their log-probabilities, the decoded text."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    # True when the stop token ended it (it is the last token id), False when the budget did.
    stopped: bool

    def to_json(self) -> dict:
        return {"prompt_ids": list(self.prompt_ids), "token_ids": list(self.token_ids),
                "logprobs": list(self.logprobs), "text": self.text, "stopped": self.stopped}

    @classmethod
    def from_json(cls, data: dict) -> Completion:
        return cls(prompt_ids=tuple(data["prompt_ids"]), token_ids=tuple(data["token_ids"]),
                   logprobs=tuple(data["logprobs"]), text=data["text"], stopped=data["stopped"])


class InferenceEngine:
    """A Hugging Face causal LM on one device, driven by the GRPO loop."""

    def __init__(self, hf_path: str, *, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(hf_path)
        self.pad_token_id = pad_token_id(self.tokenizer, where=hf_path)
        with output_to_log("transformers"):  # its "Loading weights" progress bar
            self.model = AutoModelForCausalLM.from_pretrained(
                hf_path, dtype=dtype, **loading_options(dtype)).to(self.device)
        self.model.eval()
        self._weights = HFModelEngine(self.model)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._weights_valid = True
        self._released: dict[str, tuple[torch.Size, torch.dtype]] = {}

    # -- refit target ---------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(hf_name, tensor)`` pairs into the model (the refit receiver calls this)."""
        if self._released:
            raise RuntimeError("load_weights while the engine's memory is released; call "
                               "reacquire_memory first")
        self._weights.load_weights(weights)

    def load_weight_pieces(self, pieces) -> None:
        """Copy ``(name, piece, region)`` triples into their regions (tensor-parallel trainers
        send sharded tensors in pieces)."""
        if self._released:
            raise RuntimeError("load_weight_pieces while the engine's memory is released; call "
                               "reacquire_memory first")
        self._weights.load_weight_pieces(pieces)

    def get_weight(self, name: str) -> torch.Tensor:
        return self._weights.get_weight(name)

    def mark_weights_loaded(self) -> None:
        """Declare the weights complete (after a refit that loaded every planned tensor)."""
        self._weights_valid = True

    # -- memory (colocated mode) ------------------------------------------------------------

    def release_memory(self) -> None:
        """Free the parameters' device memory; buffers (e.g. RoPE tables) are kept.

        The parameter objects stay (the refit target keeps references), their storage is
        dropped. Generation is refused until :meth:`reacquire_memory` and a refit.
        """
        if self._released:
            return
        for name, param in self.model.named_parameters():
            self._released[name] = (param.shape, param.dtype)
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        self._weights_valid = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reacquire_memory(self) -> None:
        """Allocate the parameters again (uninitialised: a refit must fill them)."""
        named = dict(self.model.named_parameters())
        for name, (shape, dtype) in self._released.items():
            named[name].data = torch.empty(shape, dtype=dtype, device=self.device)
        self._released.clear()

    # -- generation -------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], *, num_samples: int, sampling: SamplingConfig,
                 seed: int | None = None) -> list[list[Completion]]:
        """``num_samples`` completions for each prompt, grouped per prompt.

        With ``seed`` the sampler restarts from it (the same prompts, weights and seed give the
        same completions); without, it continues from the previous call.
        """
        if not self._weights_valid:
            raise RuntimeError("the engine's weights were released and no refit has loaded "
                               "them since; refusing to generate")
        if seed is not None:
            self._generator.manual_seed(seed)
        stop_id = stop_token_id(self.tokenizer, sampling.stop_token)
        prompt_ids = [tuple(self.tokenizer(p, add_special_tokens=False)["input_ids"])
                      for p in prompts]
        self._check_positions(prompts, prompt_ids, sampling.max_new_tokens)
        expanded = [ids for ids in prompt_ids for _ in range(num_samples)]
        tokens, logprobs, lengths, stopped = self._sample(expanded, sampling, stop_id)
        completions = []
        for row, ids in enumerate(expanded):
            n = lengths[row]
            token_ids = tuple(tokens[row, :n].tolist())
            text_ids = token_ids[:-1] if stopped[row] else token_ids
            completions.append(Completion(
                prompt_ids=ids,
                token_ids=token_ids,
                logprobs=tuple(logprobs[row, :n].tolist()),
                text=self.tokenizer.decode(list(text_ids), skip_special_tokens=False),
                stopped=bool(stopped[row]),
            ))
        return [completions[i * num_samples:(i + 1) * num_samples] for i in range(len(prompts))]

    def _check_positions(self, prompts: Sequence[str], prompt_ids: Sequence[tuple[int, ...]],
                         max_new_tokens: int) -> None:
        """Refuse a prompt that leaves no room for ``max_new_tokens`` within the model's
        positions (beyond them, a model extrapolates or fails, and every step slows)."""
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if not isinstance(positions, int):
            return
        for prompt, ids in zip(prompts, prompt_ids, strict=True):
            if len(ids) + max_new_tokens > positions:
                raise ValueError(
                    f"a prompt ({prompt[:60]!r}{'…' if len(prompt) > 60 else ''}) is "
                    f"{len(ids)} tokens; with "
                    f"inference.sampling.max_new_tokens={max_new_tokens} it needs "
                    f"{len(ids) + max_new_tokens} positions, more than the model's {positions} "
                    "(max_position_embeddings): shorten the prompts or lower "
                    "inference.sampling.max_new_tokens")

    def _sample(self, prompts: list[tuple[int, ...]], sampling: SamplingConfig, stop_id: int):
        """Batched sampling with left-padded prompts and a KV cache."""
        batch = len(prompts)
        width = max(len(p) for p in prompts)
        pad = self.pad_token_id
        input_ids = torch.full((batch, width), pad, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            mask[row, width - len(ids):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)

        out_tokens = torch.full((batch, sampling.max_new_tokens), pad, dtype=torch.long,
                                device=self.device)
        out_logprobs = torch.zeros((batch, sampling.max_new_tokens), dtype=torch.float32,
                                   device=self.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        lengths = torch.full((batch,), sampling.max_new_tokens, dtype=torch.long,
                             device=self.device)
        past, step_ids, step_positions = None, input_ids, positions
        for step in range(sampling.max_new_tokens):
            output = self.model(input_ids=step_ids, attention_mask=mask,
                                position_ids=step_positions, past_key_values=past,
                                use_cache=True)
            past = output.past_key_values
            scaled = output.logits[:, -1].float() / sampling.temperature
            log_probs = torch.log_softmax(scaled, dim=-1)
            token = (log_probs.argmax(dim=-1) if sampling.greedy
                     else self._draw(log_probs, sampling.top_p))
            token = torch.where(finished, torch.full_like(token, pad), token)
            out_tokens[:, step] = token
            out_logprobs[:, step] = torch.where(
                finished, 0.0, log_probs.gather(1, token.unsqueeze(1)).squeeze(1))
            just_stopped = ~finished & (token == stop_id)
            lengths = torch.where(just_stopped, step + 1, lengths)
            finished |= just_stopped
            if bool(finished.all()):
                break
            step_ids = token.unsqueeze(1)
            step_positions = step_positions[:, -1:] + 1
            mask = torch.cat([mask, (~finished).long().unsqueeze(1)], dim=1)
        return out_tokens.cpu(), out_logprobs.cpu(), lengths.tolist(), finished.tolist()

    def _draw(self, log_probs: torch.Tensor, top_p: float) -> torch.Tensor:
        probs = top_p_filter(log_probs.exp(), top_p)
        return torch.multinomial(probs, 1, generator=self._generator).squeeze(1)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs [rows, vocab]`` with every token outside each row's nucleus set to 0.

    The nucleus is the smallest set of most likely tokens whose mass reaches ``top_p`` (always at
    least one token); the kept probabilities are not renormalised (``torch.multinomial`` does not
    need it).
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def stop_token_id(tokenizer, stop_token: str | None) -> int:
    """The id of ``sampling.stop_token``: the tokenizer's end-of-sequence token when null."""
    if stop_token is None:
        if tokenizer.eos_token_id is None:
            raise ValueError("sampling.stop_token is null and the tokenizer has no eos token")
        return tokenizer.eos_token_id
    token_id = tokenizer.convert_tokens_to_ids(stop_token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"sampling.stop_token {stop_token!r} is not a token of the tokenizer")
    return token_id


def pad_token_id(tokenizer, *, where: str) -> int:
    """The tokenizer's pad token, or its end-of-sequence token when it has none (as verl does).

    Padding never reaches the loss or the sampled text (it sits outside every mask), so any token
    serves; ``where`` names the tokenizer in the error when it has neither.
    """
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    raise ValueError(f"the tokenizer in {where} has neither a pad token nor an eos token")
