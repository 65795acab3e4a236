"""Policy parity on 4 GPUs (device machine, NCCL): TP2×PP2×VPP2 against TP1×PP1, fp32 and bf16.

Three launches of the CPU suite's scenario script on CUDA: 1 rank (PP1, the reference), 2 ranks
(TP2: the same tensor-parallel split without pipelining) and 4 ranks (TP2×PP2×VPP2), each the same
three optimizer steps. Run with ``-s`` to see the figures: each test prints one ``FIGURES`` line.
Bounds are asserted (tests/gpu/policy_figures.py); bitwise equality is reported, not asserted (GPU
kernels may pick other algorithms per launch, and the embedding backward uses atomics).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.policy_results import load, run_parity
from tests.gpu.policy_figures import DTYPES, check_against_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs"),
]


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
    check_against_reference(f"tp2_pp2_vpp2_vs_{reference_layout}_{dtype}", run, reference,
                            labels=("tp2_pp2_vpp2", reference_layout), dtype=dtype)
    assert [s["num_tokens"] for s in run["steps"]] == [s["num_tokens"] for s in reference["steps"]]
