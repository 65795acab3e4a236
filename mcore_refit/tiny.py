"""Tiny random-weight Hugging Face checkpoints for tests, demos and benchmarks; no network.

:func:`write_tiny_checkpoint` writes ``config.json``, ``model.safetensors`` and a character-level
tokenizer built locally, so ``AutoBridge``, ``AutoModelForCausalLM`` and ``AutoTokenizer`` all load
the directory offline.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

Architecture = Literal["llama", "qwen2", "qwen3_moe", "gemma2"]

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
# Digits, letters, punctuation and space: enough for arithmetic and sorting prompts.
TOKEN_CHARS = string.digits + string.ascii_letters + string.punctuation + " "


# Sizes of a tiny model that vLLM's CPU kernels run: heads of size 32, the smallest its
# attention takes (recipes/make_tiny_model.py's defaults).
VLLM_SIZES = {"hidden_size": 128, "intermediate_size": 256}


@dataclass(frozen=True, kw_only=True)
class TinyModelSpec:
    """Architecture of a tiny checkpoint. Defaults give a ~0.2M-parameter GQA model with heads of
    size 16, which vLLM's CPU attention refuses: for vLLM take ``VLLM_SIZES`` (heads of 32)."""

    architecture: Architecture = "llama"
    num_layers: int = 4
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # Must cover the tokenizer (len(SPECIAL_TOKENS) + len(TOKEN_CHARS) = 99).
    vocab_size: int = 128
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    # qwen3_moe: routed experts per layer, experts per token, and each expert's MLP width.
    num_experts: int = 8
    num_experts_per_token: int = 2
    moe_intermediate_size: int = 32

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "num_experts",
                     "moe_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of "
                             f"num_attention_heads={self.num_attention_heads}")
        if not 1 <= self.num_experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_token={self.num_experts_per_token} must be in "
                             f"[1, num_experts={self.num_experts}]")
        min_vocab = len(SPECIAL_TOKENS) + len(TOKEN_CHARS)
        if self.vocab_size < min_vocab:
            raise ValueError(f"vocab_size={self.vocab_size} is below the tokenizer's {min_vocab}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )


def write_tiny_checkpoint(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a random-weight checkpoint plus tokenizer for ``spec`` to ``out_dir``.

    Weights are a deterministic function of ``spec`` (seeded). Norm weights are perturbed away
    from 1 so that a norm exported into the wrong slot would be noticed. ``out_dir`` must be new
    or empty: ``save_pretrained`` deletes the ``*.safetensors`` files it finds there.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{str(out)!r} exists and is not an empty directory; writing a "
                         "checkpoint there would replace (and delete the *.safetensors of) what "
                         "it holds: choose a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    model = _build_hf_model(spec)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def build_tokenizer():
    """A character-level fast tokenizer over :data:`TOKEN_CHARS`, built without any download."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in TOKEN_CHARS:
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def _build_hf_model(spec: TinyModelSpec):
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=1e-5,
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        eos_token_id=SPECIAL_TOKENS.index("</s>"),
    )
    if spec.architecture == "llama":
        config, model_cls = LlamaConfig(**common), LlamaForCausalLM
    elif spec.architecture == "qwen2":
        config, model_cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif spec.architecture == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common, head_dim=spec.hidden_size // spec.num_attention_heads,
            num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_token,
            moe_intermediate_size=spec.moe_intermediate_size, decoder_sparse_step=1,
            mlp_only_layers=[], norm_topk_prob=True)
        model_cls = Qwen3MoeForCausalLM
    elif spec.architecture == "gemma2":
        config = Gemma2Config(**common, head_dim=spec.hidden_size // spec.num_attention_heads,
                              query_pre_attn_scalar=spec.hidden_size // spec.num_attention_heads)
        model_cls = Gemma2ForCausalLM
    else:
        raise ValueError(f"unknown tiny architecture {spec.architecture!r} "
                         "(llama, qwen2, qwen3_moe, gemma2)")
    config.architectures = [model_cls.__name__]
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.device("cpu"):
        torch.manual_seed(spec.seed)
        model = model_cls(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    model = model.to(getattr(torch, spec.dtype))
    model.config.dtype = getattr(torch, spec.dtype)
    return model.eval()
