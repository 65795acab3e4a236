"""Export and gradient parity on 2 GPUs (NCCL): the same scenarios as the CPU test."""

import json

import pytest
import torch

from tests.dist.conftest import EXPORT_PARITY
from tests.dist.test_export_parity import EXPECTED_TENSORS, assert_exact_with_parity
from tests.launch import run_torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("export_parity_gpu")
    out = workdir / "results.json"
    run_torchrun(EXPORT_PARITY, "--workdir", str(workdir), "--out", str(out), nproc=2,
                 timeout_s=600)
    return json.loads(out.read_text())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", sorted(EXPECTED_TENSORS))
def test_layout_exports_exactly_with_gradient_parity_on_gpu(results, scenario):
    assert results[scenario]["device"] == "cuda"
    assert_exact_with_parity(results[scenario], scenario)


@pytest.mark.timeout(900)
def test_corrupted_weight_is_named_on_gpu(results):
    assert results["corrupted"]["mismatched"] == ["model.norm.weight"]


@pytest.mark.timeout(900)
def test_export_reads_current_parameters_on_gpu(results):
    assert results["fresh"]["replaced"] == [5.0] and results["fresh"]["tasks_rebuilt"]
