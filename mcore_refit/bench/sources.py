"""What the benchmark refits: a synthetic set, or a Megatron model laid out over the trainer
ranks (random weights of a preset architecture, or a checkpoint), and the variants the modes
compare it with (Megatron-Bridge's own export; the same tensors captured in memory)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mcore_refit import distributed
from mcore_refit.bench.config import MegatronSourceConfig, RefitBenchJob
from mcore_refit.bench.synthetic import SyntheticWeightSource, synthetic_specs
from mcore_refit.config import ModelConfig
from mcore_refit.control import ControlGroup
from mcore_refit.model import build_model
from mcore_refit.refit import (
    LocalSource,
    ModelExport,
    PlannedBuffer,
    RefitPlan,
    RefitSource,
    SharedMemoryParameters,
    SourceLayout,
    TensorSpec,
)

# Hugging Face config fields of the preset architectures (random weights need no files).
PRESETS = {
    "llama3_8b": ("LlamaForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-5)),
    "qwen3_30b_a3b": ("Qwen3MoeForCausalLM", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, vocab_size=151936,
        max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
        decoder_sparse_step=1, mlp_only_layers=[])),
    "tiny_llama": ("LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
        tie_word_embeddings=False, rms_norm_eps=1e-5)),
    # Qwen3-30B-A3B's structure at toy size (CPU tests): 8 experts, top-2.
    "tiny_qwen3_moe": ("Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, vocab_size=128, max_position_embeddings=256,
        tie_word_embeddings=False, rms_norm_eps=1e-6, decoder_sparse_step=1, mlp_only_layers=[])),
}


@dataclass
class BenchSources:
    """The sources the modes refit from, on one trainer rank."""

    main: RefitSource
    bridge: BridgeExport | None
    rank: int
    model: object | None = None
    # On CPU with the shared_weights mode: the model's parameters in a shared-memory file.
    shared_parameters: SharedMemoryParameters | None = None
    _captured: Captured | None = None

    def close(self) -> None:
        """Remove the shared-memory file of the parameters, if any (idempotent)."""
        if self.shared_parameters is not None:
            self.shared_parameters.close()

    def for_mode(self, mode: str) -> RefitSource:
        """The source ``mode`` refits (or exports) from."""
        if mode in ("bridge_export", "bridge_export_alone"):
            return self.bridge
        if mode == "transport_alone" and self.model is not None:
            return self.captured()
        # A synthetic source's tensors are in memory already: its refit is the transport alone
        # (a copy would only take memory the MoE set on one GPU does not have).
        return self.main

    def prepare(self, mode: str, plan: RefitPlan) -> None:
        """What ``mode``'s refits need before the first one: ``transport_alone``'s capture
        (collective over the trainer ranks)."""
        source = self.for_mode(mode)
        if isinstance(source, Captured):
            source.capture(plan)

    def captured(self) -> Captured:
        """The main source's tensors captured in memory (built on first use, then kept)."""
        if self._captured is None:
            self._captured = Captured(self.main, rank=self.rank)
        return self._captured


def build_sources(job: RefitBenchJob, *, device: torch.device, control: ControlGroup,
                  prefer=()) -> BenchSources:
    """The benchmark's sources on a trainer rank; for the Megatron source a collective over the
    trainer ranks (``control``: a gloo group over them)."""
    bench = job.bench
    if bench.source != "megatron":
        specs = synthetic_specs(bench.source, dtype=bench.torch_dtype)
        source = SyntheticWeightSource(specs, device=device, seed=bench.seed)
        return BenchSources(main=LocalSource(source), bridge=None, rank=control.rank)
    model = build_megatron(job.megatron, device=device)
    model.eval()
    shared = None
    if "shared_weights" in bench.modes and device.type == "cpu":
        # The engine reads the parameters in place: on CPU they must be in a file it can map.
        shared = SharedMemoryParameters(model.chunks, ipc_dir=job.refit.transport.ipc_dir)
    return BenchSources(main=ModelExport(model, control=control, device=device, prefer=prefer),
                        bridge=BridgeExport(model, control=control), rank=control.rank,
                        model=model, shared_parameters=shared)


def build_megatron(config: MegatronSourceConfig, *, device: torch.device):
    """The Megatron model chunks for ``config`` (its layout's groups included)."""
    model_parallel = distributed.init_model_parallel(config.parallel, seed=1234)
    hf_path = config.hf_path
    if hf_path is None:
        hf_path = write_preset_config(config.preset, num_layers=config.num_layers)
    model_config = ModelConfig(hf_path=hf_path, dtype=config.dtype, layer_spec=config.layer_spec,
                               load_weights=config.load_weights and config.hf_path is not None)
    return build_model(model_config, model_parallel, device=device)


def preset_config(preset: str, *, num_layers: int | None = None):
    """The transformers config of ``preset`` (at ``num_layers`` layers when given)."""
    from transformers import AutoConfig

    architecture, fields = PRESETS[preset]
    fields = dict(fields)
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    model_type = {"LlamaForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3_moe"}[architecture]
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [architecture]
    return config


def write_preset_config(preset: str, *, num_layers: int | None = None) -> str:
    """A config-only checkpoint directory for ``preset`` (random weights need no files)."""
    path = tempfile.mkdtemp(prefix=f"refit_bench_{preset}_")
    preset_config(preset, num_layers=num_layers).save_pretrained(path)
    return path


class Captured:
    """A source's tensors captured once in memory: refits from it move the same bytes from the
    same ranks without exporting (the benchmark's ``transport_alone``).

    The capture reads one pass of the source (collective over the trainer ranks, at the first
    :meth:`begin`) and keeps a copy of this rank's tensors; it holds that much memory.
    """

    def __init__(self, source: RefitSource, *, rank: int) -> None:
        self._source = source
        self._rank = rank
        self._tensors: list[tuple[str, torch.Tensor]] | None = None
        self._fingerprint: str | None = None

    def layout(self) -> SourceLayout:
        return self._source.layout()

    def begin(self, plan: RefitPlan) -> _CapturedPass:
        self.capture(plan)
        return _CapturedPass(self._tensors)

    def capture(self, plan: RefitPlan) -> None:
        """Capture the tensors ``plan`` sends from this rank, unless held for it already."""
        if self._fingerprint != plan.fingerprint:
            self._tensors = None  # the old capture's memory first
            self._tensors = self._capture(plan)
            self._fingerprint = plan.fingerprint

    def _capture(self, plan: RefitPlan) -> list[tuple[str, torch.Tensor]]:
        refit_pass = self._source.begin(plan)
        own = refit_pass.own_weights()
        tensors = []
        for buffer in plan.buffers:
            refit_pass.exchange(buffer, timeout_s=600.0)
            if buffer.source == self._rank:
                for _ in range(buffer.num_tensors):
                    name, tensor = next(own)
                    if hasattr(tensor, "materialize"):
                        tensor = tensor.materialize()
                    tensors.append((name, tensor.detach().clone()))
        return tensors


class _CapturedPass:
    stable_tensors = True

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._tensors = tensors

    def exchange(self, buffer: PlannedBuffer, *, timeout_s: float) -> None:
        pass

    def own_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._tensors)


def export_pass(source: RefitSource, plan: RefitPlan, *, rank: int, timeout_s: float) -> None:
    """One pass over ``source`` for ``plan`` that moves nothing: every exchange, and every tensor
    this rank (``rank`` among the trainer ranks) would send, produced and dropped (a tensor made
    of pieces stays in pieces, as packing reads it). Collective over the trainer ranks."""
    refit_pass = source.begin(plan)
    own = refit_pass.own_weights()
    for buffer in plan.buffers:
        refit_pass.exchange(buffer, timeout_s=timeout_s)
        if buffer.source == rank:
            for _ in range(buffer.num_tensors):
                next(own)


class BridgeExport:
    """Megatron-Bridge's own export as a refit source: the baseline.

    Every trainer rank yields every full tensor (Bridge's pipeline broadcast and tensor-parallel
    all-gather per tensor); trainer rank 0 is the source of every buffer and the other trainer
    ranks read the export in step with it (in ``exchange``). The refit benchmark measures it as
    ``bridge_export``; its specs come from one export pass. ``control`` is a gloo group over the
    trainer ranks.
    """

    def __init__(self, model, *, control: ControlGroup) -> None:
        self._model = model
        self._control = control
        self._rank = control.rank
        self._specs: list[TensorSpec] | None = None

    def layout(self) -> SourceLayout:
        if self._specs is None:
            self._specs = [TensorSpec.of(name, tensor)
                           for name, tensor in self._model.export_hf_weights()]
        return SourceLayout(specs=list(self._specs), sources=[0] * len(self._specs))

    def begin(self, plan: RefitPlan) -> _BridgePass:
        """One export pass (collective over the trainer ranks); Bridge's conversion tasks are
        built again when any rank replaced a parameter object."""
        replaced = self._control.any_true(self._model.parameters_replaced(),
                                          what="whether a trainer rank replaced a parameter")
        return _BridgePass(self._model.export_hf_weights(rebuild=replaced), rank=self._rank)


class _BridgePass:
    stable_tensors = False

    def __init__(self, stream: Iterator[tuple[str, torch.Tensor]], *, rank: int) -> None:
        self._stream = stream
        self._rank = rank

    def exchange(self, buffer: PlannedBuffer, *, timeout_s: float) -> None:
        if self._rank != buffer.source:
            for _ in range(buffer.num_tensors):
                next(self._stream)

    def own_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._stream if self._rank == 0 else iter(())
