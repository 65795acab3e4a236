"""Policy parity on 4 GPUs (device machine, NCCL): TP2×PP2×VPP2 against TP1×PP1, fp32 and bf16.

Three launches of the CPU suite's scenario script on CUDA: 1 rank (PP1, the reference), 2 ranks
(TP2: the same tensor-parallel split without pipelining) and 4 ranks (TP2×PP2×VPP2), each the same
three optimizer steps. Run with ``-s`` to see the figures: each test prints one ``FIGURES`` line.
Tolerances are asserted (the 2-GPU suite's); bitwise equality is reported, not asserted (GPU
kernels may pick other algorithms per launch, and the embedding backward uses atomics).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.dist.policy_results import load, parity_figures, run_parity, step_values
from tests.gpu.test_policy_gpu import TOLERANCE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs"),
]

DTYPES = ("float32", "bfloat16")


def _report(name: str, figures: dict) -> None:
    print(f"FIGURES {name} {json.dumps(figures, sort_keys=True)}", flush=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("policy_x4_gpu")
    hf_path = write_tiny_checkpoint(root / "llama8", TinyModelSpec(num_layers=8))
    out_dir = root / "runs"
    out_dir.mkdir()
    for nproc, layout in ((1, "pp1"), (2, "tp2"), (4, "tp2_pp2_vpp2")):
        run_parity(hf_path=hf_path, out_dir=out_dir, nproc=nproc, layouts=[layout],
                   dtypes=list(DTYPES), timeout_s=300)
    return {path.stem: load(path) for path in out_dir.glob("*.pt")}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("reference_layout", ["pp1", "tp2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tp2_pp2_vpp2_matches(runs, dtype, reference_layout):
    run, reference = runs[f"tp2_pp2_vpp2_{dtype}"], runs[f"{reference_layout}_{dtype}"]
    figures = parity_figures(run, reference)
    figures["losses"] = step_values(run, "loss")
    figures["grad_norms"] = step_values(run, "grad_norm")
    figures["seconds"] = {"tp2_pp2_vpp2": run["seconds"], reference_layout: reference["seconds"]}
    _report(f"tp2_pp2_vpp2_vs_{reference_layout}_{dtype}", figures)
    tolerance = TOLERANCE[dtype]
    assert figures["loss_rel"] <= tolerance["loss_rel"], figures
    assert figures["grad_norm_rel"] <= tolerance["grad_norm_rel"], figures
    assert figures["weights_max_abs"] <= tolerance["weights"], figures
    assert figures["logprobs_final_max_abs"] <= tolerance["logprobs"], figures
    assert [s["num_tokens"] for s in run["steps"]] == [s["num_tokens"] for s in reference["steps"]]
    assert torch.equal(run["reference_logprobs_final"], run["logprobs_initial"])
    assert torch.equal(run["logprobs_after_reference"], run["logprobs_final"])
