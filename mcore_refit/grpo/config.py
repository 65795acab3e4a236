"""The GRPO job's configuration: one YAML file, sections by concern."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mcore_refit.config import ConfigError, Dtype, ModelConfig, ParallelConfig
from mcore_refit.grpo.rewards import resolve_reward
from mcore_refit.grpo.run_config import RunConfig
from mcore_refit.grpo.tasks import (
    ArithmeticTask,
    JsonlTask,
    Operation,
    Task,
    check_arithmetic_settings,
    dress_prompts,
    template_fields,
)
from mcore_refit.inference.engine import SamplingConfig
from mcore_refit.inference.vllm.engine import VLLM_TOP_P_PROBLEM, VllmOptions
from mcore_refit.policy.config import PolicyConfig
from mcore_refit.refit import RefitConfig


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Where prompts and answers come from, how prompts are dressed, how answers are scored."""

    kind: Literal["arithmetic", "jsonl"] = "arithmetic"
    # arithmetic: operands of up to num_digits digits (in [min_operand, max_operand]), answer
    # modulo `modulo` when set
    num_digits: int = 1
    operation: Operation = "add"
    modulo: int | None = None
    max_operand: int | None = None
    min_operand: int = 0
    # jsonl: a file of JSON objects, one per line, with the prompt and the answer under these keys
    path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    # A str.format template for the prompt: {prompt} and, for jsonl, any key of the line.
    prompt_template: str | None = None
    # Wrap the (templated) prompt in the tokenizer's chat template as one user turn.
    chat_template: bool = False
    # A built-in reward (exact_match, last_number, hash_answer, boxed, digit_match) or
    # package.module:function, called as function(problem, completion) -> float.
    reward: str = "exact_match"

    def __post_init__(self) -> None:
        if self.kind == "jsonl" and not self.path:
            raise ConfigError("`kind`=jsonl needs `path`")
        if self.kind == "arithmetic":
            for key in ("path", "prompt_key", "answer_key"):
                if getattr(self, key) != TaskConfig.__dataclass_fields__[key].default:
                    raise ConfigError(f"`{key}` is only used with `kind`=jsonl")
            check_arithmetic_settings(num_digits=self.num_digits, operation=self.operation,
                                      modulo=self.modulo, max_operand=self.max_operand,
                                      min_operand=self.min_operand)
        if self.prompt_template is not None:
            names = template_fields(self.prompt_template)
            if self.kind == "arithmetic" and names - {"prompt"}:
                raise ConfigError(f"`prompt_template` may only use {{prompt}} with "
                                  f"`kind`=arithmetic, got {sorted(names)}")
        if self.reward is not None:
            try:
                resolve_reward(self.reward)
            except ValueError as error:
                raise ConfigError(f"`reward`: {error}") from None

    def build(self, *, seed: int, hf_path: str) -> Task:
        """The task this config describes, seeded, its prompts dressed as configured (the
        tokenizer at ``hf_path`` is read only when ``chat_template`` is set)."""
        task: Task
        if self.kind == "jsonl":
            task = JsonlTask(path=self.path, seed=seed, prompt_key=self.prompt_key,
                             answer_key=self.answer_key)
        else:
            task = ArithmeticTask(seed=seed, num_digits=self.num_digits, operation=self.operation,
                                  modulo=self.modulo, max_operand=self.max_operand,
                                  min_operand=self.min_operand)
        return dress_prompts(task, template=self.prompt_template,
                             chat_template=self.chat_template, hf_path=hf_path)


@dataclass(frozen=True, kw_only=True)
class EvalConfig(TaskConfig):
    """A validation set scored with greedy decoding, one completion per prompt: the same task
    options as ``task`` (its reward defaults to ``task.reward``)."""

    reward: str | None = None
    # How many problems: drawn once from the (seeded) task; null takes every line of a jsonl file.
    num_problems: int | None = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_problems is None and self.kind != "jsonl":
            raise ConfigError("`num_problems` may only be null with `kind`=jsonl")
        if self.num_problems is not None and self.num_problems < 1:
            raise ConfigError(f"`num_problems` must be ≥ 1 or null, got {self.num_problems}")


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """Sampling budget per step and the loss."""

    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    normalize_advantages: bool = True
    # Subtracted from the reward of a completion the token budget cut off (no stop token).
    truncated_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1:
            raise ConfigError(f"`prompts_per_step` must be ≥ 1, got {self.prompts_per_step}")
        if self.truncated_penalty < 0:
            raise ConfigError(f"`truncated_penalty` must be ≥ 0, got {self.truncated_penalty}")
        if self.samples_per_prompt < 2:
            raise ConfigError("`samples_per_prompt` must be ≥ 2 (advantages compare samples of "
                              f"one prompt), got {self.samples_per_prompt}")


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    """The inference engine: the embedded Hugging Face sampler or vLLM."""

    # hf: the embedded Hugging Face sampler (mcore_refit.inference.engine), the exact reference;
    # vllm: a vLLM engine (mcore_refit.inference.vllm), with the same sampling and logprobs.
    engine: Literal["hf", "vllm"] = "hf"
    # Non-colocated mode: how many of the launched ranks serve inference (the last ones).
    num_ranks: int = 1
    # Parameter dtype of the engine's model; it must match the trainer's export dtype.
    dtype: Dtype = "float32"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Colocated mode: free the engine's weights while the trainer trains.
    release_memory: bool = True
    # Colocated mode: move the trainer's weights and optimizer to host memory while generating.
    offload_trainer: bool = False
    # Bound on one engine command (generation of one step, a refit).
    timeout_s: float = 600.0
    # inference.engine=vllm: how vLLM's engine is sized.
    vllm: VllmOptions = field(default_factory=VllmOptions)

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ConfigError(f"`num_ranks` must be ≥ 1, got {self.num_ranks}")
        if not self.timeout_s > 0:
            raise ConfigError(f"`timeout_s` must be > 0, got {self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class GRPOJobConfig:
    """Everything ``recipes/grpo.py`` reads from its YAML file."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    # Optional validation set, scored every `run.eval_every` steps.
    eval: EvalConfig | None = None
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        temperature = self.inference.sampling.temperature
        if self.policy.temperature != temperature:
            raise ConfigError(
                f"`policy.temperature`={self.policy.temperature} differs from "
                f"`inference.sampling.temperature`={temperature}; the trainer must score the "
                "distribution the engine samples from"
            )
        if self.inference.engine == "vllm" and self.inference.sampling.top_p < 1:
            raise ConfigError(f"`inference.sampling.top_p`={self.inference.sampling.top_p} with "
                              f"`inference.engine`=vllm: {VLLM_TOP_P_PROBLEM}")
        if self.inference.dtype != self.model.dtype:
            raise ConfigError(f"`inference.dtype`={self.inference.dtype} differs from "
                              f"`model.dtype`={self.model.dtype}; refits copy tensors as exported")
        if self.run.eval_every > 0 and self.eval is None:
            raise ConfigError("`run.eval_every` > 0 needs an `eval` section")
        if self.grpo.kl_coef > 0 and not self.policy.reference_model:
            raise ConfigError("`grpo.kl_coef` > 0 needs `policy.reference_model`: true")
        if self.refit.transport.ipc_sharing == "weights":
            if self.refit.mode != "colocated":
                raise ConfigError("`refit.transport.ipc_sharing`=weights is for "
                                  "`refit.mode`=colocated")
            if self.inference.offload_trainer:
                raise ConfigError(
                    "`refit.transport.ipc_sharing`=weights keeps the trainer's weights mapped "
                    "by the engine, so `inference.offload_trainer`=true would free no memory; "
                    "use ipc_sharing=buffers with offloading")

    @property
    def collective_timeout_s(self) -> float:
        """Timeout for the job's process groups.

        Longer than any bounded wait a rank can be in (an engine reply, a refit buffer) while
        its peers wait in a collective: the rank that knows what went wrong raises first and
        shares why, instead of the peers failing on a bare collective timeout. Inference ranks
        of a non-colocated job also wait this long for trainer rank 0's next command, so a
        training step must take less (raise ``inference.timeout_s`` for longer steps).
        """
        transport = self.refit.transport
        return max(transport.start_timeout_s, transport.timeout_s,
                   self.inference.timeout_s) + 60.0
