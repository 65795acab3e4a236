"""The compatibility layer, exercised in fresh interpreters (its patches are process-wide)."""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the CPU patches are inactive on CUDA machines")

PROBE = r"""
import json, sys
import torch
from mcore_refit import compat
compat.install()
compat.install()  # idempotent
import megatron.bridge  # must import without transformer-engine
from megatron.bridge.peft import lora_layers
from megatron.core.transformer.utils import get_default_causal_mask
from megatron.core.tensor_parallel import get_cuda_rng_tracker

result = {
    "te_in_sys_modules": any(name.split(".")[0] == "transformer_engine" for name in sys.modules),
    "patches": list(compat.installed_patches()),
    "literal_cuda_device": str(torch.zeros(2, device="cuda").device),
    "tensor_cuda": str(torch.ones(1).cuda().device),
    "current_device": str(torch.cuda.current_device()),
    "type_query": torch.ones(1).type(),
    "type_cast": str(torch.ones(1).type(torch.float64).dtype),
    "causal_mask": get_default_causal_mask(3).tolist(),
    "te_stub_fails": None,
}
with get_cuda_rng_tracker().fork():
    torch.nn.functional.dropout(torch.ones(4), 0.5)
try:
    lora_layers.te.Linear(1, 1)
except RuntimeError as error:
    result["te_stub_fails"] = str(error)
print(json.dumps(result))
"""


def run_probe(code):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bridge_imports_and_cpu_patches_apply():
    result = run_probe(PROBE)
    assert result["te_in_sys_modules"] is False
    assert result["patches"] == [
        "bridge: lora_layers without transformer_engine",
        "torch.cuda.current_device -> cpu",
        "get_default_causal_mask -> cpu",
        "cuda rng tracker -> no-op inference tracker",
        "Tensor.type() -> torch.cuda.* spelling",
        "torch.cuda.synchronize -> no-op",
        "torch.cuda.Stream/stream/current_stream -> host no-ops",
        "device='cuda' literals and Tensor.cuda() -> cpu",
    ]
    assert result["literal_cuda_device"] == "cpu"
    assert result["tensor_cuda"] == "cpu"
    assert result["current_device"] == "cpu"
    assert result["type_query"] == "torch.cuda.FloatTensor"
    assert result["type_cast"] == "torch.float64"
    assert result["causal_mask"] == [[False, True, True], [False, False, True],
                                     [False, False, False]]
    assert result["te_stub_fails"] == (
        "Linear needs transformer-engine, which is not installed; "
        "use the local layer spec (model.layer_spec: local)")


@pytest.mark.slow
def test_install_after_bridge_import_is_an_error():
    code = ("from mcore_refit import compat\n"
            "import sys, types\n"
            "sys.modules['megatron.bridge.peft.lora_layers'] = types.ModuleType('x')\n"
            "try:\n    compat.install()\nexcept RuntimeError as e:\n"
            "    import json; print(json.dumps({'error': str(e)}))\n")
    assert run_probe(code)["error"] == (
        "megatron.bridge.peft.lora_layers was imported before mcore_refit.compat.install(); "
        "import mcore_refit before megatron.bridge")


LAZY_BRIDGE_PROBE = r"""
import json, sys
from mcore_refit import compat

def imported(name):
    return name in sys.modules

auto_bridge = compat.import_auto_bridge("Qwen3MoeForCausalLM")
result = {
    "qwen3_moe_bridge": imported("megatron.bridge.models.qwen.qwen3_moe_bridge"),
    "llama_bridge": imported("megatron.bridge.models.llama.llama_bridge"),
    "deepseek_bridge": imported("megatron.bridge.models.deepseek"),
    "qwen3_moe_bridge_found": auto_bridge.supports(type("C", (), {
        "architectures": ["Qwen3MoeForCausalLM"]})()),
}
import megatron.bridge  # a later plain import completes the packages on first use of a name
result["same_class"] = megatron.bridge.AutoBridge is auto_bridge
result["deepseek_after"] = imported("megatron.bridge.models.deepseek")
result["lora_layers_after"] = imported("megatron.bridge.peft.lora_layers")
from megatron.bridge.models import DeepSeekV3Bridge
result["name_from_models"] = DeepSeekV3Bridge.__name__
result["full_import_class"] = compat.import_auto_bridge("SomeOtherForCausalLM") is auto_bridge
print(json.dumps(result))
"""


@pytest.mark.slow
def test_a_known_architecture_imports_only_its_bridge_and_the_rest_on_first_use():
    # Megatron-Bridge's package __init__ imports every bridge it ships (~2 s of CPU per process);
    # for a listed architecture only AutoBridge and that bridge are imported, and the packages'
    # own bodies still run, untouched, as soon as anything looks up a name they define.
    assert run_probe(LAZY_BRIDGE_PROBE) == {
        "qwen3_moe_bridge": True, "llama_bridge": False, "deepseek_bridge": False,
        "qwen3_moe_bridge_found": True,
        "same_class": True, "deepseek_after": True, "lora_layers_after": True,
        "name_from_models": "DeepSeekV3Bridge", "full_import_class": True,
    }


def test_a_missing_megatron_bridge_names_the_install_command(monkeypatch):
    import importlib.util

    from mcore_refit import compat

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(compat, "_installed", [])
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "megatron.bridge" else find_spec(name, *a))
    with pytest.raises(ImportError, match=r"megatron-bridge is not installed; .* pip install "
                                          r"--no-deps -r requirements-nodeps.txt"):
        compat.install()
    assert compat._installed == []
