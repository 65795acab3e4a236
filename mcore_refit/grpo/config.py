"""The GRPO job's configuration: one YAML file, sections by concern."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mcore_refit.config import ConfigError, Dtype, ModelConfig, ParallelConfig
from mcore_refit.grpo.tasks import Operation, check_arithmetic_settings
from mcore_refit.inference.engine import SamplingConfig
from mcore_refit.policy.config import PolicyConfig
from mcore_refit.refit.config import RefitConfig


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Where prompts and answers come from."""

    kind: Literal["arithmetic", "jsonl"] = "arithmetic"
    # arithmetic: operands of up to num_digits digits (at most max_operand when set), answer
    # modulo `modulo` when set
    num_digits: int = 1
    operation: Operation = "add"
    modulo: int | None = None
    max_operand: int | None = None
    # jsonl: a file of {"prompt": ..., "answer": ...} lines
    path: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "jsonl" and not self.path:
            raise ConfigError("`kind`=jsonl needs `path`")
        if self.kind == "arithmetic" and self.path is not None:
            raise ConfigError("`path` is only used with `kind`=jsonl")
        if self.kind == "arithmetic":
            check_arithmetic_settings(num_digits=self.num_digits, operation=self.operation,
                                      modulo=self.modulo, max_operand=self.max_operand)


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """Sampling budget per step and the loss."""

    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    normalize_advantages: bool = True

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1:
            raise ConfigError(f"`prompts_per_step` must be ≥ 1, got {self.prompts_per_step}")
        if self.samples_per_prompt < 2:
            raise ConfigError("`samples_per_prompt` must be ≥ 2 (advantages compare samples of "
                              f"one prompt), got {self.samples_per_prompt}")


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    """The embedded inference engine."""

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

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ConfigError(f"`num_ranks` must be ≥ 1, got {self.num_ranks}")
        if not self.timeout_s > 0:
            raise ConfigError(f"`timeout_s` must be > 0, got {self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Steps, seeds, outputs."""

    steps: int = 20
    seed: int = 1234
    output_dir: str = "runs/grpo"
    # Save a checkpoint every this many steps (and at the end); 0 saves only at the end.
    checkpoint_every: int = 0
    # Compare the engine's weights with the trainer's export after every refit (slow; tests).
    verify_refit: bool = False
    tensorboard: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"`steps` must be ≥ 1, got {self.steps}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"`checkpoint_every` must be ≥ 0, got {self.checkpoint_every}")


@dataclass(frozen=True, kw_only=True)
class GRPOJobConfig:
    """Everything ``recipes/grpo.py`` reads from its YAML file."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
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
        if self.inference.dtype != self.model.dtype:
            raise ConfigError(f"`inference.dtype`={self.inference.dtype} differs from "
                              f"`model.dtype`={self.model.dtype}; refits copy tensors as exported")
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
