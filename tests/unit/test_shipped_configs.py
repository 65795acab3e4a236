"""Every YAML file in configs/ loads into the dataclasses of the recipe that reads it.

The GPU configs never run in CI; a misspelt key or a bad value in them is caught here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_refit.bench.config import RefitBenchJob
from mcore_refit.config import ConfigError, load_config
from mcore_refit.grpo.config import GRPOJobConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
JOBS = (GRPOJobConfig, RefitBenchJob)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_config_is_read_by_exactly_one_recipe(path):
    """A file no recipe can load (a stray or renamed key) fails here, whatever its name."""
    loads = []
    for job_class in JOBS:
        try:
            load_config(job_class, str(path), [])
        except ConfigError:
            continue
        loads.append(job_class.__name__)
    assert len(loads) == 1, f"{path.name} loads as {loads or 'nothing'}"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("grpo_*.yaml")), ids=lambda p: p.stem)
def test_grpo_config_loads(path):
    config = load_config(GRPOJobConfig, str(path), [])
    expected_mode = "non_colocated" if "non_colocated" in path.stem else "colocated"
    assert config.refit.mode == expected_mode
    if "pp2_vpp2" in path.stem:
        assert (config.parallel.pipeline, config.parallel.virtual_pipeline) == (2, 2)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("refit_bench*.yaml")), ids=lambda p: p.stem)
def test_refit_bench_config_loads(path):
    job = load_config(RefitBenchJob, str(path), [])
    # Both bench configs default to the non-colocated placement (colocated is an override).
    assert job.refit.mode == "non_colocated"


def test_collective_timeout_outlasts_every_bounded_wait():
    path = CONFIGS / "grpo_tiny_cpu_colocated.yaml"
    config = load_config(GRPOJobConfig, str(path), ["refit.transport.timeout_s=30",
                                                    "refit.transport.start_timeout_s=45",
                                                    "inference.timeout_s=700"])
    assert config.collective_timeout_s == 760.0
