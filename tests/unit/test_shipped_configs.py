"""Every YAML file in configs/ loads into the dataclasses of the recipe that reads it.

The GPU configs never run in CI; a misspelt key or a bad value in them is caught here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from mcore_refit.config import load_config
from mcore_refit.grpo_config import GRPOJobConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = CONFIGS.parent / "recipes"


def _refit_bench_job_class():
    spec = importlib.util.spec_from_file_location("refit_bench_recipe", RECIPES / "refit_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module.RefitBenchJob


def test_every_config_is_covered():
    names = sorted(path.name for path in CONFIGS.glob("*.yaml"))
    assert names and all(name.startswith(("grpo_", "refit_bench")) for name in names), names


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("grpo_*.yaml")), ids=lambda p: p.stem)
def test_grpo_config_loads(path):
    config = load_config(GRPOJobConfig, str(path), [])
    expected_mode = "non_colocated" if "non_colocated" in path.stem else "colocated"
    assert config.refit.mode == expected_mode
    if "pp2_vpp2" in path.stem:
        assert (config.parallel.pipeline, config.parallel.virtual_pipeline) == (2, 2)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("refit_bench*.yaml")), ids=lambda p: p.stem)
def test_refit_bench_config_loads(path):
    job = load_config(_refit_bench_job_class(), str(path), [])
    # Both bench configs default to the non-colocated placement (colocated is an override).
    assert job.refit.mode == "non_colocated"


def test_collective_timeout_outlasts_every_bounded_wait():
    path = CONFIGS / "grpo_tiny_cpu_colocated.yaml"
    config = load_config(GRPOJobConfig, str(path), ["refit.timeout_s=30",
                                                    "refit.start_timeout_s=45",
                                                    "inference.timeout_s=700"])
    assert config.collective_timeout_s == 760.0
