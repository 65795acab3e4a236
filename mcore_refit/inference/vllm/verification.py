"""Checking a refit inside vLLM: the engine's parameters against vLLM's plain loader, bitwise.

The trainer's digests prove the HF tensors arrived intact. What vLLM made of them is checked
against a :class:`ReferenceModel`: a second instance of the engine's model class, built from the
same vLLM config, into which the same tensors go through the model's plain ``load_weights``
(no layerwise reload, no processing). Every parameter of the engine must equal its reference
twin bit for bit.

On CPU vLLM computes each linear layer from a repacked oneDNN copy and leaves its ``weight``
empty; such a weight is read back through the layer's own GEMM with an identity matrix
(``I @ W.T``: every output element is one weight times 1.0 plus zeros, exact in any float
type). Its fused MoE may prepack the experts' weights in place (same shape, other order, on
CPUs without AMX): the reference's are prepacked the same way before the comparison.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_MAX_NAMES_SHOWN = 10


class ReferenceModel:
    """The engine's model class, instantiated again, for verification only (as much memory as
    the model's weights)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @classmethod
    def build(cls, vllm_config, device: torch.device) -> ReferenceModel:
        """A fresh instance of ``vllm_config``'s model on ``device`` (weights uninitialised).

        Its attention layers register under their names in a forward context of their own, so
        the engine's registry (which maps names to its KV cache) is left as it was.
        """
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        compilation = vllm_config.compilation_config
        engines_layers = compilation.static_forward_context
        compilation.static_forward_context = {}
        try:
            with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device(device):
                model = initialize_model(vllm_config=vllm_config)
        finally:
            compilation.static_forward_context = engines_layers
        return cls(model)

    def compare(self, engine_model: torch.nn.Module,
                weights: Iterable[tuple[str, torch.Tensor]]) -> str | None:
        """Load ``weights`` into the reference with the plain loader, then compare every
        parameter of ``engine_model`` with it; ``None`` when all are bitwise equal."""
        with torch.no_grad():
            self.model.load_weights(weights)
            engine_modules = dict(engine_model.named_modules())
            differ, checked = [], 0
            for module_name, reference_module in self.model.named_modules():
                module = engine_modules.get(module_name)
                for name, expected in reference_module.named_parameters(recurse=False):
                    label = f"{module_name}.{name}" if module_name else name
                    actual = None
                    if module is not None:
                        expected = as_the_engine_holds(module, name, expected)
                        actual = read_parameter(module, name, expected)
                    checked += 1
                    if actual is None or not bitwise_equal(actual, expected):
                        differ.append(label)
        if not differ:
            return None
        shown = ", ".join(repr(n) for n in differ[:_MAX_NAMES_SHOWN])
        more = (f" and {len(differ) - _MAX_NAMES_SHOWN} more"
                if len(differ) > _MAX_NAMES_SHOWN else "")
        return (f"vLLM check failed: {len(differ)} of {checked} vLLM parameters differ from what "
                f"vLLM's own loader makes of the received tensors: {shown}{more}")


def as_the_engine_holds(module: torch.nn.Module, name: str,
                       expected: torch.Tensor) -> torch.Tensor:
    """``expected`` (as the plain loader leaves ``module.<name>``) in the layout the engine's
    ``module`` computes with, where vLLM rearranges a weight without changing its shape: on CPU
    its fused MoE prepacks the experts' weights for its grouped GEMM (``vec`` on x86 without
    AMX, ``amx`` for bf16 with it; other CPUs keep them as loaded)."""
    fused = getattr(getattr(module, "quant_method", None), "cpu_fused_moe", None)
    grouped = getattr(fused, "forward_grouped_gemm", None)
    if name not in ("w13_weight", "w2_weight") or grouped is None \
            or getattr(fused, "forward_method", None) != grouped:
        return expected
    from vllm._custom_ops import cpu_prepack_moe_weight

    return cpu_prepack_moe_weight(expected.contiguous(), fused.isa)


def read_parameter(module: torch.nn.Module, name: str,
                   like: torch.Tensor) -> torch.Tensor | None:
    """The value vLLM computes with for ``module.<name>``, shaped as ``like`` (the
    unprocessed parameter); ``None`` when it cannot be read back in that shape."""
    param = getattr(module, name, None)
    if param is None:
        return None
    if param.shape == like.shape and param.dtype == like.dtype:
        return param.detach()
    gemm = getattr(module, "cpu_linear", None)
    if name == "weight" and param.numel() == 0 and gemm is not None and like.dim() == 2:
        # CPU: the weight lives only in the layer's packed copy; x @ W.T with x = I is W.T.
        identity = torch.eye(like.shape[1], dtype=like.dtype, device=like.device)
        return gemm(identity, param, None).t()
    return None


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaNs with the same payload compare equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))
