"""Megatron model chunks built from a Hugging Face checkpoint through Megatron-Bridge.

With virtual pipeline parallelism a rank holds several model chunks (one per virtual stage).
:class:`ModelChunks` owns that list and is what the rest of the library passes around; nothing
reaches for ``chunks[0]``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mcore_refit import compat
from mcore_refit.config import ModelConfig, ParallelConfig
from mcore_refit.distributed import ModelParallel
from mcore_refit.logs import output_to_log

# TE-only fusions; without transformer-engine each must be off before provider.finalize(), or
# Megatron raises e.g. "apply_rope_fusion is not available. Please install TE".
_TE_ONLY_FUSIONS = (
    "apply_rope_fusion",
    "masked_softmax_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
    "gradient_accumulation_fusion",
    # MoE: the MoE bridges turn these on; without TE, megatron-core raises "fused permutation is
    # not available" (transformer_config.py:2651) or builds the legacy GroupedMLP, which needs the
    # grouped_gemm package (moe_grouped_gemm=False gives SequentialMLP).
    "moe_permute_fusion",
    "moe_grouped_gemm",
)


@dataclass(frozen=True)
class ModelShape:
    """The few architecture facts needed to validate a layout before building anything."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    tie_word_embeddings: bool
    architecture: str
    pad_token_id: int | None
    # Experts per MoE layer; None for a dense model.
    num_experts: int | None = None


def _declared_architecture(hf_path: str) -> str | None:
    """The first entry of ``architectures`` in ``hf_path/config.json``, read before Megatron-Bridge
    is imported (its import registers configuration classes ``AutoConfig`` may need)."""
    try:
        architectures = json.loads((Path(hf_path) / "config.json").read_text())["architectures"]
        return architectures[0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None  # read_model_shape names the problem


def read_model_shape(hf_path: str) -> ModelShape:
    """Read the architecture facts from ``hf_path/config.json`` (no weights are loaded)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(hf_path)
    except OSError as error:
        raise ValueError(
            f"model.hf_path={hf_path!r} is not a Hugging Face checkpoint: {error}"
        ) from error
    architectures = getattr(config, "architectures", None) or ["<unset>"]
    return ModelShape(
        num_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        vocab_size=config.vocab_size,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        architecture=architectures[0],
        pad_token_id=getattr(config, "pad_token_id", None),
        num_experts=_num_experts(config),
    )


def _num_experts(config) -> int | None:
    """Routed experts per MoE layer under the names transformers' MoE configs use."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_layer_spec(requested: str, parallel: ParallelConfig) -> str:
    """``auto`` becomes ``te`` when transformer-engine imports, ``local`` otherwise."""
    te = compat.te_available()
    if requested == "te" and not te:
        raise ValueError("model.layer_spec='te' needs transformer-engine, which does not import")
    resolved = ("te" if te else "local") if requested == "auto" else requested
    if parallel.sequence_parallel and resolved != "te":
        raise ValueError(
            "parallel.sequence_parallel=true needs the transformer-engine layer spec; the local "
            "spec's torch LayerNorm does not support it (set parallel.sequence_parallel: false)"
        )
    return resolved


class ParameterSnapshot:
    """Which ``Parameter`` object every module of ``chunks`` held when taken.

    :meth:`replaced` looks at the same module slots again instead of walking the module tree, so
    it costs microseconds per refit. It sees a slot given a new ``Parameter`` (``module.weight =
    nn.Parameter(...)``, ``load_state_dict(assign=True)``); a whole submodule swapped for another
    is not seen (build the refit source again after such surgery).
    """

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        self._slots = [(module._parameters, name, param)
                       for chunk in chunks for module in chunk.modules()
                       for name, param in module._parameters.items() if param is not None]

    def replaced(self) -> bool:
        return any(table.get(name) is not param for table, name, param in self._slots)

    def replacements(self) -> dict[int, torch.nn.Parameter]:
        """``id(old parameter) → the parameter now in its slot``, for every replaced one."""
        return {id(param): table[name] for table, name, param in self._slots
                if table.get(name) is not param and table.get(name) is not None}


@dataclass(eq=False)
class ModelChunks:
    """The model chunks this rank holds (one per virtual pipeline stage) and their bridge.

    ``chunks`` may be wrapped (Megatron DDP, Float16Module); :meth:`unwrapped` gives the
    underlying ``GPTModel`` objects in the same order.
    """

    chunks: list[torch.nn.Module]
    bridge: Any  # megatron.bridge.AutoBridge
    model_config: ModelConfig
    model_parallel: ModelParallel
    shape: ModelShape
    layer_spec: str
    _conversion_tasks: list | None = field(default=None, repr=False)
    _task_params: ParameterSnapshot | None = field(default=None, repr=False)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def parallel(self) -> ParallelConfig:
        """The layout the chunks were built for."""
        return self.model_parallel.parallel

    def unwrapped(self) -> list[torch.nn.Module]:
        from megatron.core.utils import unwrap_model

        return unwrap_model(self.chunks)

    @property
    def transformer_config(self):
        """The Megatron ``TransformerConfig`` shared by all chunks."""
        from megatron.core.utils import get_model_config

        return get_model_config(self.chunks[0])

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """Parameters of every chunk, chunk by chunk."""
        for chunk in self.chunks:
            yield from chunk.parameters()

    def train(self) -> None:
        for chunk in self.chunks:
            chunk.train()

    def eval(self) -> None:
        for chunk in self.chunks:
            chunk.eval()

    def parameters_replaced(self) -> bool:
        """Whether this rank replaced a parameter object since the conversion tasks were built
        (local: the caller agrees on it with the other ranks before exporting)."""
        return self._task_params is not None and self._task_params.replaced()

    def conversion_tasks(self, *, rebuild: bool = False) -> list:
        """Bridge conversion tasks (Megatron → HF), built once and reused.

        The tasks hold references to the ``Parameter`` objects, so in-place updates (optimizer
        steps, ``.data`` moves for offload, ``load_state_dict``) are exported as they are. A
        replaced parameter object is not: when :meth:`parameters_replaced` is true on any rank,
        pass ``rebuild=True`` on every rank. Building is collective over the model-parallel
        group (it gathers parameter names across pipeline stages).
        """
        if self._conversion_tasks is None or rebuild:
            model_bridge = self.bridge._model_bridge
            # AutoBridge.get_conversion_tasks insists on checkpoint weights; the model bridge's
            # builder also accepts the bare HF config (hf_pretrained is a PretrainedConfig when the
            # bridge was made with from_hf_config), which is what random-weight models have.
            self._conversion_tasks = model_bridge.build_conversion_tasks(
                self.bridge.hf_pretrained, self.unwrapped()
            )
            self._task_params = ParameterSnapshot(self.chunks)
        return self._conversion_tasks

    def export_hf_weights(self, *, rebuild: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``(hf_name, full_tensor)`` pairs (tensors stay on the model's device);
        ``rebuild`` as for :meth:`conversion_tasks`.

        Collective: every rank of the model-parallel groups must iterate it to the end, in
        lockstep, or ranks deadlock. Every rank receives every full tensor.
        """
        # merge_adapter_weights=False: mcore_refit builds no LoRA adapters, and the adapter merge
        # would run an all_gather_object over the pipeline group on every export.
        yield from self.bridge.export_hf_weights(
            self.chunks, cpu=False, show_progress=False,
            conversion_tasks=self.conversion_tasks(rebuild=rebuild), merge_adapter_weights=False,
        )


def build_model(model_config: ModelConfig, model_parallel: ModelParallel, *,
                device: torch.device, wrap_with_ddp: bool = False, ddp_config: Any = None,
                provider_overrides: dict[str, Any] | None = None) -> ModelChunks:
    """Build this rank's model chunks from ``model_config.hf_path`` in the layout that
    :func:`mcore_refit.distributed.init_model_parallel` returned.

    Call on every rank. The layout is validated against the checkpoint's architecture first.
    ``provider_overrides`` sets further ``GPTModelProvider`` fields (e.g. ``seq_length``).
    """
    import torch.distributed as dist

    AutoBridge = compat.import_auto_bridge(  # noqa: N806 (a class)
        _declared_architecture(model_config.hf_path))

    parallel = model_parallel.parallel
    shape = read_model_shape(model_config.hf_path)
    parallel.validate_for_model(
        world_size=dist.get_world_size(),
        num_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        num_experts=shape.num_experts,
    )
    layer_spec = resolve_layer_spec(model_config.layer_spec, parallel)

    if model_config.load_weights:
        bridge = AutoBridge.from_hf_pretrained(model_config.hf_path)
    else:
        from transformers import AutoConfig

        bridge = AutoBridge.from_hf_config(AutoConfig.from_pretrained(model_config.hf_path))
    provider = bridge.to_megatron_provider(load_weights=model_config.load_weights)
    layer_spec = _configure_provider(provider, model_config, parallel, layer_spec, device)
    for key, value in (provider_overrides or {}).items():
        if not hasattr(provider, key):
            raise ValueError(f"provider override '{key}' is not a GPTModelProvider field")
        setattr(provider, key, value)
    provider.finalize()
    _check_pipeline_comm(provider, parallel)
    _check_spec_without_te(provider, shape.architecture)

    # Megatron-Bridge prints here: the parameter count of each rank's chunks and a progress bar
    # of the weight loading. Both go to the log file.
    with output_to_log("megatron.bridge"):
        chunks = provider.provide_distributed_model(
            wrap_with_ddp=wrap_with_ddp,
            ddp_config=ddp_config,
            use_cpu_initialization=device.type == "cpu",
            bf16=model_config.dtype == "bfloat16",
            fp16=model_config.dtype == "float16",
        )
    return ModelChunks(chunks=list(chunks), bridge=bridge, model_config=model_config,
                       model_parallel=model_parallel, shape=shape, layer_spec=layer_spec)


def _configure_provider(provider, model_config: ModelConfig, parallel: ParallelConfig,
                        layer_spec: str, device: torch.device) -> str:
    """Set the layout, dtype and layer spec on ``provider``; returns the layer spec's name."""
    provider.tensor_model_parallel_size = parallel.tensor
    provider.pipeline_model_parallel_size = parallel.pipeline
    provider.virtual_pipeline_model_parallel_size = parallel.virtual_pipeline
    provider.expert_model_parallel_size = parallel.expert
    provider.sequence_parallel = parallel.sequence_parallel
    dtype = model_config.torch_dtype
    provider.params_dtype = dtype
    provider.pipeline_dtype = dtype
    provider.bf16 = model_config.dtype == "bfloat16"
    provider.fp16 = model_config.dtype == "float16"
    layer_spec = _choose_layer_spec(provider, layer_spec)
    if not compat.te_available() or layer_spec == "local":
        for fusion in _TE_ONLY_FUSIONS:
            if hasattr(provider, fusion):
                setattr(provider, fusion, False)
    if getattr(provider, "num_moe_experts", None):
        # The router's auxiliary losses add gradients the HF model's loss does not have.
        provider.moe_aux_loss_coeff = model_config.moe_aux_loss_coeff
        provider.moe_z_loss_coeff = None
        if device.type == "cpu" and parallel.expert > 1:
            # The all-to-all dispatcher hands all_to_all_single numpy split sizes
            # (tensor_parallel/mappings.py:450-466, from token_dispatcher.py:930-945), which
            # gloo refuses; the allgather dispatcher moves the same tokens with all-gathers.
            provider.moe_token_dispatcher_type = "allgather"
    if device.type == "cpu":
        # p2p_communication.py:419 calls torch.cuda.synchronize() after batched p2p when set.
        provider.batch_p2p_sync = False
    # With interleaving at PP=2 the previous and next stage are the same peer, and Megatron's
    # batched p2p (batch_p2p_comm=True) then pairs sends and receives wrongly: losses and gradients
    # are silently wrong (seen with gloo and NCCL). Separate, overlapped p2p ops are exact.
    if parallel.virtual_pipeline is not None:
        provider.overlap_p2p_comm = True
        provider.batch_p2p_comm = False


def _choose_layer_spec(provider, layer_spec: str) -> str:
    """Keep a bridge's own layer spec; swap only Megatron-Bridge's generic default for the
    resolved ``layer_spec`` (``te`` or ``local``). Returns the name of the spec in use."""
    from megatron.bridge.models import gpt_provider

    generic = (gpt_provider.default_layer_spec, gpt_provider.transformer_engine_layer_spec,
               gpt_provider.local_layer_spec)
    current = provider.transformer_layer_spec
    if any(current is spec for spec in generic):
        provider.transformer_layer_spec = (gpt_provider.transformer_engine_layer_spec
                                           if layer_spec == "te" else gpt_provider.local_layer_spec)
        return layer_spec
    # Gemma2/3, OLMoE, DeepSeek (MLA, first-k dense layers), ...: the spec is the architecture.
    return f"bridge:{_spec_name(current)}"


def _spec_name(spec) -> str:
    func = getattr(spec, "func", spec)  # functools.partial
    return getattr(func, "__name__", type(func).__name__)


def _check_spec_without_te(provider, architecture: str) -> None:
    """A bridge's own layer spec that builds transformer-engine modules cannot run without TE:
    say so by architecture instead of failing deep inside the model build."""
    if compat.te_available():
        return
    spec = provider.transformer_layer_spec
    if callable(spec) and not hasattr(spec, "submodules"):
        import inspect

        try:
            takes_vp = "vp_stage" in inspect.signature(spec).parameters
            spec = spec(provider, vp_stage=0) if takes_vp else spec(provider)
        except Exception:  # noqa: BLE001 - let the model build report its own error
            return
    te_modules = sorted(_te_modules(spec))
    if te_modules:
        raise ValueError(
            f"{architecture}: Megatron-Bridge's own layer spec for this architecture "
            f"({_spec_name(provider.transformer_layer_spec)}) builds transformer-engine modules "
            f"({', '.join(te_modules)}), and transformer-engine does not import here; this "
            "architecture needs a machine with transformer-engine")


def _te_modules(spec) -> set[str]:
    """Where a (block or layer) ``ModuleSpec`` refers to transformer-engine: TE classes by name,
    and the submodule slots holding megatron's stand-ins for TE classes when TE is absent
    (``MagicMock`` objects, e.g. ``TELayerNormColumnParallelLinear`` imported by Gemma2's spec)."""
    import dataclasses
    import functools
    from unittest import mock

    found: set[str] = set()
    stack, seen = [("spec", spec)], set()
    while stack:
        label, item = stack.pop()
        if isinstance(item, mock.NonCallableMock):
            found.add(label)
            continue
        if id(item) in seen or item is None:
            continue
        seen.add(id(item))
        if isinstance(item, type):
            if any(_is_te_module(cls) for cls in item.__mro__):
                found.add(item.__name__)
        elif isinstance(item, functools.partial):
            stack += [(label, v) for v in (item.func, *item.args, *item.keywords.values())]
        elif isinstance(item, (list, tuple)):
            stack += [(label, v) for v in item]
        elif isinstance(item, dict):
            stack += [(key, v) for key, v in item.items()]
        elif dataclasses.is_dataclass(item):
            stack += [(f.name, getattr(item, f.name)) for f in dataclasses.fields(item)]
        elif hasattr(item, "module") and hasattr(item, "submodules"):  # ModuleSpec
            stack += [(label, item.module), (label, item.submodules),
                      (label, getattr(item, "params", None))]
    return found


def _is_te_module(cls: type) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return "transformer_engine" in module or module.endswith(".te_layers")


def _check_pipeline_comm(provider, parallel: ParallelConfig) -> None:
    if parallel.virtual_pipeline is None:
        return
    if provider.batch_p2p_comm or not provider.overlap_p2p_comm:
        raise ValueError(
            "virtual pipeline parallelism requires overlap_p2p_comm=True and batch_p2p_comm=False "
            f"(got overlap_p2p_comm={provider.overlap_p2p_comm}, "
            f"batch_p2p_comm={provider.batch_p2p_comm}); batched p2p gives wrong gradients when "
            "the previous and next pipeline stage are the same rank"
        )
