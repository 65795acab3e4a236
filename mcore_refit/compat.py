"""Compatibility layer for the pinned stack: the one place that patches third-party code.

Four independent concerns live here:

1. ``megatron.bridge`` without transformer-engine. ``megatron/bridge/peft/lora_layers.py`` (line 20)
   does ``import transformer_engine.pytorch as te`` at module level; TE is needed there only for
   LoRA-on-TE-layer classes. A meta-path finder rewrites that single line for that single module to
   bind ``te`` to an inert namespace. ``transformer_engine`` is never put in ``sys.modules``:
   megatron-core probes for it and would then believe TE is installed.

2. Megatron-core on a machine without CUDA (tests and the CPU demo, gloo backend). Megatron-core
   hard-codes CUDA in a handful of places; each patch below names the upstream lines it works
   around. They are installed only when ``torch.cuda.is_available()`` is false, so GPU runs execute
   unpatched upstream code.

3. The refit export's tensor-parallel gather (:func:`pregathered_tp_shards`), active only around
   one conversion step at a time.

4. The checkpoint writer's results queue (:func:`in_process_write_results`), active only around
   one synchronous save.

Call :func:`install` once per process before importing ``megatron.bridge``, or get its
``AutoBridge`` from :func:`import_auto_bridge`, which installs first (``mcore_refit.model`` does)
and for a known architecture imports only that architecture's bridge. Both are idempotent.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import queue
import sys
import threading
import types

import torch
from torch.overrides import TorchFunctionMode

from mcore_refit.logs import output_to_log

_LORA_MODULE = "megatron.bridge.peft.lora_layers"
_TE_IMPORT_LINE = "import transformer_engine.pytorch as te"
_TE_REPLACEMENT_LINE = "from mcore_refit.compat import INERT_TE as te"

_install_lock = threading.Lock()
_installed: list[str] = []


def te_available() -> bool:
    """True when transformer-engine's PyTorch extension imports."""
    return importlib.util.find_spec("transformer_engine") is not None and _te_imports()


def _te_imports() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken TE install counts as absent
        return False
    return True


def installed_patches() -> tuple[str, ...]:
    """Names of the patches active in this process (for logs and tests)."""
    return tuple(_installed)


def install() -> None:
    """Install the bridge import hook and, without CUDA, the CPU patches. Idempotent.

    Raises ``ImportError`` saying how to install megatron-bridge when it is missing (it cannot be
    a declared dependency of this package; see ``pyproject.toml``).
    """
    with _install_lock:
        if _installed:
            return
        if importlib.util.find_spec("megatron.bridge") is None:
            raise ImportError(
                "megatron-bridge is not installed; install it without its declared dependencies "
                "(CUDA-only builds): pip install --no-deps -r requirements-nodeps.txt "
                "(megatron-bridge==0.6.2)")
        if not te_available():
            _install_bridge_import_hook()
            _installed.append("bridge: lora_layers without transformer_engine")
        if not torch.cuda.is_available():
            _install_cpu_patches()
        if not _installed:
            _installed.append("none")


# Megatron-Bridge's package ``__init__`` files (megatron/bridge/__init__.py and
# megatron/bridge/models/__init__.py, megatron-bridge 0.6.2) import every bridge it ships, each with
# its Hugging Face modeling module: ~2 s of CPU per process here, half of the bridge's import. A
# bridge registers itself for its Hugging Face class when its module is imported, so for the
# architectures below AutoBridge finds its bridge with only that module imported.
_BRIDGE_MODULE_BY_ARCHITECTURE = {
    "LlamaForCausalLM": "megatron.bridge.models.llama",
    "MistralForCausalLM": "megatron.bridge.models.mistral",
    "Qwen2ForCausalLM": "megatron.bridge.models.qwen",
    "Qwen3ForCausalLM": "megatron.bridge.models.qwen",
    "Qwen3MoeForCausalLM": "megatron.bridge.models.qwen",
    "GemmaForCausalLM": "megatron.bridge.models.gemma",
    "Gemma2ForCausalLM": "megatron.bridge.models.gemma",
    "Gemma3ForCausalLM": "megatron.bridge.models.gemma",
    "OlmoeForCausalLM": "megatron.bridge.models.olmoe",
}
_BRIDGE_PACKAGES = ("megatron.bridge.models", "megatron.bridge")  # innermost first
_AUTO_BRIDGE_MODULE = "megatron.bridge.models.conversion.auto_bridge"


def import_auto_bridge(architecture: str | None = None) -> type:
    """Megatron-Bridge's ``AutoBridge``, imported after :func:`install`.

    For an ``architecture`` (a Hugging Face class name, as in ``config.json``) listed in
    ``_BRIDGE_MODULE_BY_ARCHITECTURE``, only ``AutoBridge`` and that architecture's bridge are
    imported; the bridge packages' own ``__init__`` bodies run when a name they define is first
    looked up (:class:`_DeferredPackageLoader`). Any other architecture, or none, imports all of
    ``megatron.bridge``.

    What it prints while importing goes to the log file, not the terminal: without
    transformer-engine its ``import_utils`` logs a failed ``FP8GlobalStateManager`` import with the
    traceback, through a stderr handler it attaches to its own logger (megatron-bridge 0.6.2,
    ``utils/import_utils.py:29-31``).
    """
    install()
    bridge_module = _BRIDGE_MODULE_BY_ARCHITECTURE.get(architecture)
    with output_to_log("megatron.bridge"):
        if bridge_module is None:
            import megatron.bridge

            _complete_deferred_packages()
            return megatron.bridge.AutoBridge
        if "megatron.bridge" not in sys.modules:
            finder = _DeferredPackageFinder()
            sys.meta_path.insert(0, finder)
            try:
                importlib.import_module("megatron.bridge")
                importlib.import_module("megatron.bridge.models")
            finally:
                sys.meta_path.remove(finder)
        importlib.import_module(bridge_module)
        return importlib.import_module(_AUTO_BRIDGE_MODULE).AutoBridge


class _DeferredPackageLoader(importlib.abc.Loader):
    """Loads a package without running its ``__init__``; the body runs (as the package's real
    loader would run it) when a name the package does not have yet is looked up on it."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def __getattr__(self, name):  # get_source, get_filename, get_resource_reader, ...
        return getattr(self.loader, name)

    def exec_module(self, module):
        module.__deferred_loader__ = self.loader
        module.__getattr__ = functools.partial(_attribute_after_init, module)


def _attribute_after_init(module, name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    _complete_deferred_packages()
    try:
        return module.__dict__[name]
    except KeyError:
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}") from None


def _complete_deferred_packages() -> None:
    """Run the deferred ``__init__`` bodies, innermost package first (``megatron.bridge``'s body
    imports ``megatron.bridge.models`` for its registrations)."""
    for name in _BRIDGE_PACKAGES:
        module = sys.modules.get(name)
        loader = module.__dict__.pop("__deferred_loader__", None) if module else None
        if loader is not None:
            del module.__getattr__
            with output_to_log("megatron.bridge"):
                loader.exec_module(module)


class _DeferredPackageFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _BRIDGE_PACKAGES:
            return None
        spec = _spec_from_the_other_finders(self, name, path, target)
        if spec is not None:
            spec.loader = _DeferredPackageLoader(spec.loader)
        return spec


def _spec_from_the_other_finders(finder_itself, name, path, target):
    """The spec the import system would find for ``name`` without ``finder_itself``."""
    for finder in sys.meta_path:
        if finder is finder_itself or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


# --------------------------------------------------------------------------------------------
# 1. megatron.bridge without transformer-engine
# --------------------------------------------------------------------------------------------


class _InertTEClass:
    """Stand-in for a TE class referenced by lora_layers; constructing one means TE was needed."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__name__} needs transformer-engine, which is not installed; "
            "use the local layer spec (model.layer_spec: local)"
        )


def _inert_classes(*names: str) -> dict[str, type]:
    return {name: type(name, (_InertTEClass,), {}) for name in names}


INERT_TE = types.SimpleNamespace(
    ops=types.SimpleNamespace(
        **_inert_classes(
            "Sequential", "LayerNorm", "RMSNorm", "Quantize", "MakeExtraOutput", "Linear",
            "Dropout", "BasicLinear", "AddExtraInput", "ConstantScale",
        )
    ),
    **_inert_classes("Linear", "LayerNormLinear"),
)


class _LoraLayersLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        # Compile from source every time: a cached .pyc would hold the unpatched import.
        path = self.get_filename(fullname)
        source = self.get_data(path).decode()
        if _TE_IMPORT_LINE not in source:
            raise ImportError(
                f"{path}: expected line {_TE_IMPORT_LINE!r} not found; the pinned megatron-bridge "
                "changed and mcore_refit.compat needs an update"
            )
        source = source.replace(_TE_IMPORT_LINE, _TE_REPLACEMENT_LINE, 1)
        return compile(source, path, "exec", dont_inherit=True)


class _LoraLayersFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _LORA_MODULE:
            return None
        spec = _spec_from_the_other_finders(self, name, path, target)
        if spec is not None:
            spec.loader = _LoraLayersLoader(name, spec.origin)
        return spec


def _install_bridge_import_hook() -> None:
    if _LORA_MODULE in sys.modules:
        raise RuntimeError(
            f"{_LORA_MODULE} was imported before mcore_refit.compat.install(); "
            "import mcore_refit before megatron.bridge"
        )
    sys.meta_path.insert(0, _LoraLayersFinder())


# --------------------------------------------------------------------------------------------
# 2. megatron-core without CUDA
# --------------------------------------------------------------------------------------------

_CPU = torch.device("cpu")


def _is_cuda_device(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` in torch calls to the CPU and makes ``Tensor.cuda()`` a no-op.

    Upstream literals it covers (megatron-core 0.19.2):
      pipeline_parallel/schedules.py:749, 1121, 2292  ``torch.zeros([], ..., device="cuda")``
      optimizer/clip_grads.py:96, 108, 112, 180, 231    ``device='cuda'`` norm/overflow buffers
      transformer/utils.py:44                          attention mask helpers
      models/common/language_module/language_module.py:307  ``weight.data.cuda()`` (tied
                                                       embeddings with PP>1)
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs if kwargs is not None else {}
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        return func(*args, **kwargs)


@functools.cache
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _install_cpu_patches() -> None:
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils
    from megatron.core.tensor_parallel import random as mcore_random

    # torch.cuda.current_device() is used as a device argument throughout megatron-core:
    # models/common/embeddings/rotary_pos_embedding.py:162, 305 (RoPE inv_freq),
    # pipeline_parallel/p2p_communication.py:211-223, 334, 342 (p2p shape/recv buffers),
    # tensor_parallel/mappings.py:95, 145 (gather buffers), models/gpt/gpt_model.py:452.
    torch.cuda.current_device = lambda: _CPU
    _installed.append("torch.cuda.current_device -> cpu")

    # transformer/utils.py:39 get_default_causal_mask builds its mask with device="cuda" and is
    # lru-cached; fusions/fused_softmax.py imports it by name, so both bindings are replaced.
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    _installed.append("get_default_causal_mask -> cpu")

    # Dropout regions run under get_cuda_rng_tracker().fork() (transformer/dot_product_attention.py)
    # and the real tracker stores CUDA RNG states. Megatron's inference tracker forks to a no-op.
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _installed.append("cuda rng tracker -> no-op inference tracker")

    # megatron-core's optimizers dispatch on the legacy type string, 'torch.FloatTensor' on CPU:
    # optimizer/clip_grads.py:174, optimizer/optimizer.py:1009/1028,
    # optimizer/distrib_optimizer.py:401/466/758 compare it with 'torch.cuda.*Tensor'.
    # Only the zero-argument query form of Tensor.type() is changed; casting is untouched.
    original_type = torch.Tensor.type

    def _type_with_cuda_spelling(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            if name.startswith("torch.cuda."):
                return name
            return name.replace("torch.", "torch.cuda.", 1)
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type_with_cuda_spelling
    _installed.append("Tensor.type() -> torch.cuda.* spelling")

    # dist_checkpointing/strategies/filesystem_async.py:248 (every torch_dist save),
    # pipeline_parallel/p2p_communication.py:263/419 and others call torch.cuda.synchronize().
    torch.cuda.synchronize = lambda *args, **kwargs: None
    _installed.append("torch.cuda.synchronize -> no-op")

    # distributed/distributed_data_parallel.py:297 and distributed/param_and_grad_buffer.py:686
    # create and enter CUDA streams; on CPU every stream is the host thread.
    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda *args, **kwargs: _HostStream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    _installed.append("torch.cuda.Stream/stream/current_stream -> host no-ops")

    # The mode stays entered for the life of the process (see _CudaDeviceToCpu).
    _CudaDeviceToCpu().__enter__()
    _installed.append("device='cuda' literals and Tensor.cuda() -> cpu")


class _HostStream:
    """A CUDA stream stand-in for CPU runs: work is already ordered on the host thread."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        # transformer/moe/token_dispatcher.py:946-950 (MoEAlltoAllTokenDispatcher) records an
        # event on its device-to-host stream and calls .synchronize() on it later.
        return event if event is not None else _HostEvent()


class _HostEvent:
    """A CUDA event stand-in for CPU runs: the host thread has done the work already."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


# --------------------------------------------------------------------------------------------
# 3. Megatron-Bridge's per-tensor TP gather, pointed at shards collected per buffer
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def pregathered_tp_shards(shards_of):
    """While active, Megatron-Bridge's tensor-parallel gather returns shards collected earlier.

    ``MegatronParamMapping.gather_from_tp_ranks`` (megatron/bridge/models/conversion/
    param_mapping.py:618, megatron-bridge 0.6.2; no mapping class overrides it) all-gathers one
    tensor over the TP group per call. The refit export collects the shards of a whole buffer in
    one exchange per peer instead: ``shards_of(mapping, tensor)`` returns every TP rank's shard
    of ``tensor`` in TP-rank order, or ``None`` for a tensor it did not collect, which is then
    gathered as upstream does.
    """
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    original = MegatronParamMapping.gather_from_tp_ranks

    def gather_from_tp_ranks(self, tensor):
        shards = shards_of(self, tensor) if self.tp_size > 1 else None
        return shards if shards is not None else original(self, tensor)

    MegatronParamMapping.gather_from_tp_ranks = gather_from_tp_ranks
    try:
        yield
    finally:
        MegatronParamMapping.gather_from_tp_ranks = original


# --------------------------------------------------------------------------------------------
# 4. Megatron's checkpoint writer without a manager process
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def in_process_write_results():
    """While active, Megatron's torch_dist writer collects its write results in a plain queue.

    ``get_write_results_queue`` (megatron/core/dist_checkpointing/strategies/
    filesystem_async.py:53, megatron-core 0.19.2) makes a ``multiprocessing.Manager().Queue()``
    at the first save: a server process kept for the life of the trainer, which a trainer
    killed with SIGKILL leaves running for ever. A synchronous save writes from threads of this
    process (``write_preloaded_data_multithread``), so a ``queue.Queue`` serves it.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous
