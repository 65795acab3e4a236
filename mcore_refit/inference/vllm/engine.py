"""A vLLM engine with the embedded engine's interface: :class:`VllmEngine`.

It generates with vLLM's ``LLM`` and returns the same :class:`~mcore_refit.inference.engine.
Completion` objects as :class:`~mcore_refit.inference.engine.InferenceEngine`, which stays the exact
reference:

- prompts are tokenised by the checkpoint's own tokenizer (no special tokens) and sent as token
  ids, so both engines see the same prompt ids; completions end at the stop token (the tokenizer's
  EOS by default, vLLM's own EOS handling off) or at the token budget;
- logprobs are vLLM's ``processed_logprobs``: ``log_softmax(logits / T)`` of the sampled token,
  the trainer's definition (vLLM's default, ``raw_logprobs``, is ``log_softmax(logits)`` whatever
  the temperature). vLLM takes them after top-p truncation (renormalised over the nucleus), so
  ``top_p`` < 1 is refused; greedy decoding (evaluation) reports ``log_softmax(logits)``, the
  temperature-1 distribution, which nothing scores;
- every completion is drawn with a seed of its own, derived from the call's ``seed`` and its
  position in the call: the same prompts, weights and seed give the same completions (a resumed
  run repeats its steps); without a seed the engine draws one from its own seeded generator;
- :meth:`VllmEngine.release_memory` puts vLLM to sleep on GPU (level 2: the weights and KV cache
  are dropped, the next refit fills the weights); on CPU vLLM has no sleep mode and it frees
  nothing. On both, generation is refused until a refit marks the weights loaded again.

Weights arrive through vLLM's weight-transfer interface, which
:class:`~mcore_refit.inference.vllm.transfer.VllmWeightTransfer` drives on :attr:`VllmEngine.llm`
(the engine is built with its backend), never through this class.

vLLM runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): it starts in about a
third of the time, and the refit's receivers reach the model directly. :func:`configure_environment`
sets that and the other process-wide switches vLLM reads, once, before vLLM is imported.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_refit.config import ConfigError
from mcore_refit.inference.engine import (
    Completion,
    SamplingConfig,
    pad_token_id,
    stop_token_id,
)

logger = logging.getLogger(__name__)

# The environment every process that runs vLLM gets, unless the user set a value:
ENVIRONMENT = {
    # vLLM reports usage statistics over the network by default.
    "VLLM_NO_USAGE_STATS": "1",
    # Checkpoints are local: never ask the hub.
    "HF_HUB_OFFLINE": "1",
    # The engine core in this process, not in a child (a 9 s start instead of 23-27 s on CPU;
    # the model is then reachable from this process, where the refit's receivers run).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # vLLM's records go through the process's logging configuration (the per-rank log file),
    # instead of a handler of its own on stdout.
    "VLLM_CONFIGURE_LOGGING": "0",
}


# On CPU, also (unless set): vLLM's sampler and logprob helpers run eagerly. Compiled, they cost
# a C++ build at start-up (20 s on an idle 2-core machine, minutes on a loaded one, once per
# engine process) for nothing a tiny CPU model notices.
CPU_ENVIRONMENT = {"TORCH_COMPILE_DISABLE": "1"}


def set_where_unset(values: dict[str, str]) -> dict[str, str]:
    """Set each of ``values`` in this process's environment where the user has not set it;
    returns what it set."""
    applied = {key: value for key, value in values.items() if key not in os.environ}
    os.environ.update(applied)
    return applied


def configure_environment(device: torch.device) -> dict[str, str]:
    """Set :data:`ENVIRONMENT` (and on CPU :data:`CPU_ENVIRONMENT`) in this process where the user
    has not set a value; returns what it set. Call before vLLM is imported (it reads some
    switches at import).

    In a process without logging configuration (an engine process), vLLM's records below ERROR
    are dropped: its start-up notes would otherwise reach the terminal through Python's
    last-resort handler.
    """
    applied = set_where_unset({**ENVIRONMENT,
                               **(CPU_ENVIRONMENT if device.type == "cpu" else {})})
    if not torch.distributed.is_initialized():
        # Inherited from torchrun by an engine process: it would make vLLM's own one-process
        # group join torchrun's agent store, at an address where nothing listens (a silent
        # wait of vLLM's whole timeout). It concerns only the trainer's process group.
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if "TORCH_COMPILE_DISABLE" in applied and "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].config.disable = True  # read at its import, already done
    if not logging.getLogger().handlers:
        logging.getLogger("vllm").setLevel(logging.ERROR)
    return applied


class VllmStartError(RuntimeError):
    """vLLM could not build the engine or run its start-up forward (the message says which model
    and shape, and vLLM's reason)."""


@dataclass(frozen=True, kw_only=True)
class VllmOptions:
    """How the vLLM engine is sized (``inference.vllm``)."""

    # KV cache per engine, in bytes; null: vLLM sizes it from gpu_memory_utilization (on CPU that
    # is a share of the host's memory, which several engines on one host cannot all take).
    kv_cache_bytes: int | None = 256 * 2**20
    # GPU: the share of the device's memory this engine may use (weights, activations, KV cache).
    gpu_memory_utilization: float = 0.5
    # Sequences decoded together; a step's completions beyond it wait for a free slot.
    max_num_seqs: int = 256
    # Longest prompt + completion in tokens; null: the checkpoint's max_position_embeddings.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ConfigError(f"`kv_cache_bytes` must be ≥ 1 or null, got {self.kv_cache_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("`gpu_memory_utilization` must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"`max_num_seqs` must be ≥ 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"`max_model_len` must be ≥ 2 or null, got {self.max_model_len}")


VLLM_TOP_P_PROBLEM = ("vLLM reports the logprobs of the top-p-truncated distribution "
                      "(renormalised over the nucleus), not the trainer's log_softmax(logits / T);"
                      " use top_p=1, or the hf engine")


def check_sampling(sampling: SamplingConfig) -> None:
    """Refuse sampling whose logprobs vLLM cannot report as the trainer computes them."""
    if sampling.top_p < 1:
        raise ValueError(f"top_p={sampling.top_p} with the vLLM engine: {VLLM_TOP_P_PROBLEM}")


class VllmEngine:
    """A vLLM ``LLM`` on one device, driven by the GRPO loop like the embedded engine.

    ``hf_path`` is named as ``model.hf_path`` in errors. Raises :class:`VllmStartError` when vLLM
    cannot load the checkpoint or run a one-token start-up forward (an attention kernel that
    refuses the model's head size fails there, not at the first step). vLLM's engine lives as long
as the process.
    """

    def __init__(self, hf_path: str, *, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 options: VllmOptions = VllmOptions()) -> None:
        self.device = torch.device(device)
        configure_environment(self.device)
        self.hf_path = hf_path
        if not (Path(hf_path) / "config.json").is_file():
            raise VllmStartError(f"model.hf_path={hf_path!r} has no config.json: not a Hugging "
                                 "Face checkpoint directory")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(hf_path)
        self.pad_token_id = pad_token_id(self.tokenizer, where=hf_path)
        self._seeds = random.Random(seed)
        self._weights_valid = True
        self._asleep = False
        self.llm = self._start(dtype=dtype, seed=seed, options=options)

    def _start(self, *, dtype: torch.dtype, seed: int, options: VllmOptions):
        try:
            from vllm import LLM

            from mcore_refit.inference.vllm.backend import weight_transfer_config

            placement = {}
            if self.device.type == "cuda":
                # vLLM's worker would otherwise take the process's first visible GPU.
                placement["device_ids"] = [self.device.index or 0]
            llm = LLM(
                model=self.hf_path, dtype=str(dtype).removeprefix("torch."), seed=seed,
                **placement,
                enforce_eager=True,
                # Prompts arrive as token ids and completions are decoded here.
                skip_tokenizer_init=True,
                # Sampling is what the config says, not the checkpoint's generation_config.json.
                generation_config="vllm",
                logprobs_mode="processed_logprobs",
                kv_cache_memory_bytes=options.kv_cache_bytes,
                gpu_memory_utilization=options.gpu_memory_utilization,
                max_num_seqs=options.max_num_seqs,
                max_model_len=options.max_model_len,
                enable_sleep_mode=self.device.type == "cuda",
                use_tqdm_on_load=False,
                # Refits arrive through vLLM's weight-transfer calls, into our receivers.
                weight_transfer_config=weight_transfer_config(),
            )
        except Exception as error:
            raise VllmStartError(f"vLLM could not start on model.hf_path={self.hf_path!r} "
                                 f"({describe_model(self.hf_path)}): {error}") from error
        try:
            # One token with its logprob: runs the attention kernels and the logprob path
            # (compiled once, seconds on CPU) now rather than in the first step.
            self._generate_raw(llm, [[self._any_token_id()]],
                               [self._params(SamplingConfig(max_new_tokens=1), seed=0,
                                             stop_id=self._any_token_id())])
        except Exception as error:
            raise VllmStartError(f"vLLM's start-up forward failed on model.hf_path="
                                 f"{self.hf_path!r} ({describe_model(self.hf_path)}): "
                                 f"{type(error).__name__}: {error}") from error
        return llm

    def _any_token_id(self) -> int:
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else 0

    # -- refit target ---------------------------------------------------------------------

    def mark_weights_loaded(self) -> None:
        """Declare the weights complete (after a refit that loaded every planned tensor); cached
        prefixes, computed with the previous weights, are dropped."""
        self.llm.reset_prefix_cache()
        self._weights_valid = True

    # -- memory (colocated mode) ------------------------------------------------------------

    def release_memory(self) -> None:
        """GPU: put vLLM to sleep (level 2: weights and KV cache freed). CPU: vLLM has no sleep
        mode; nothing is freed. Generation is refused until :meth:`reacquire_memory` and a
        refit."""
        self._weights_valid = False
        if self.device.type == "cuda" and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = True

    def reacquire_memory(self) -> None:
        """Wake vLLM (weights uninitialised on GPU: a refit must fill them)."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    # -- generation -------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str], *, num_samples: int, sampling: SamplingConfig,
                 seed: int | None = None) -> list[list[Completion]]:
        """``num_samples`` completions for each prompt, grouped per prompt.

        Completion ``i`` of the call (prompt-major) is drawn with a seed derived from ``seed``
        and ``i``: the same prompts, weights and seed give the same completions. Without ``seed``
        the engine draws one from its own generator (seeded at construction).
        """
        if not self._weights_valid:
            raise RuntimeError("the engine's weights were released and no refit has loaded "
                               "them since; refusing to generate")
        check_sampling(sampling)
        stop_id = stop_token_id(self.tokenizer, sampling.stop_token)
        if seed is None:
            seed = self._seeds.getrandbits(62)
        prompt_ids = [tuple(self.tokenizer(p, add_special_tokens=False)["input_ids"])
                      for p in prompts]
        expanded = [ids for ids in prompt_ids for _ in range(num_samples)]
        params = [self._params(sampling, seed=completion_seed(seed, index), stop_id=stop_id)
                  for index in range(len(expanded))]
        outputs = self._generate_raw(self.llm, expanded, params)
        completions = []
        for ids, output in zip(expanded, outputs, strict=True):
            token_ids = tuple(output.token_ids)
            stopped = output.finish_reason == "stop"
            if stopped and token_ids[-1:] != (stop_id,):
                raise RuntimeError(f"vLLM stopped a completion at {output.stop_reason!r}, not "
                                   f"at the stop token {stop_id}")
            logprobs = tuple(step[token].logprob
                             for step, token in zip(output.logprobs, token_ids, strict=True))
            text_ids = token_ids[:-1] if stopped else token_ids
            completions.append(Completion(
                prompt_ids=ids, token_ids=token_ids, logprobs=logprobs,
                text=self.tokenizer.decode(list(text_ids), skip_special_tokens=False),
                stopped=stopped))
        return [completions[i * num_samples:(i + 1) * num_samples] for i in range(len(prompts))]

    @staticmethod
    def _params(sampling: SamplingConfig, *, seed: int, stop_id: int):
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            # vLLM decodes greedily at temperature 0.
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            seed=None if sampling.greedy else seed,
            stop_token_ids=[stop_id],
            ignore_eos=True,  # the stop token decides, as in the embedded engine
            logprobs=0,  # the sampled token's only
            detokenize=False,
        )

    @staticmethod
    def _generate_raw(llm, prompt_ids: Sequence[Sequence[int]], params) -> list:
        """vLLM's first (only) output for each prompt, in order."""
        from vllm.inputs import TokensPrompt

        results = llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids],
                               params, use_tqdm=False)
        return [result.outputs[0] for result in results]



def completion_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a call with ``seed`` (distinct per index, < 2**63)."""
    return (seed * 1_000_003 + index) % 2**63


def describe_model(hf_path: str) -> str:
    """The shape facts a kernel may refuse, from ``hf_path/config.json`` (best effort)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(hf_path)
    except (OSError, ValueError) as error:
        return f"config.json unreadable: {error}"
    heads = config.num_attention_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    return (f"{architecture}, {config.num_hidden_layers} layers, hidden size "
            f"{config.hidden_size}, {heads} heads of head size {head_size}, "
            f"{getattr(config, 'num_key_value_heads', heads)} KV heads")
