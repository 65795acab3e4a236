"""RefitConfig validation: every bad value gets an error naming its key; buffer size semantics."""

from dataclasses import dataclass, field

import pytest
import torch

from mcore_refit.config import from_dict, load_config
from mcore_refit.refit.config import DEFAULT_BUFFER_BYTES, RefitConfig, total_device_memory


@dataclass(frozen=True, kw_only=True)
class Job:
    refit: RefitConfig = field(default_factory=RefitConfig)


def test_defaults():
    config = RefitConfig()
    assert config.mode == "non_colocated" and config.num_buffers == 2
    assert config.resolve_buffer_bytes(torch.device("cpu")) == DEFAULT_BUFFER_BYTES


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "refit.yaml"
    path.write_text("refit:\n  mode: colocated\n  buffer_bytes: 4096\n  checksums: true\n")
    job = load_config(Job, path, ["refit.num_buffers=3", "refit.timeout_s=2.5"])
    assert job.refit == RefitConfig(mode="colocated", buffer_bytes=4096, checksums=True,
                                    num_buffers=3, timeout_s=2.5)


def test_buffer_size_semantics():
    cpu = torch.device("cpu")
    assert RefitConfig(buffer_bytes=1000 * 256 + 17).resolve_buffer_bytes(cpu) == 1000 * 256
    fraction = RefitConfig(buffer_fraction=0.001).resolve_buffer_bytes(cpu)
    total = total_device_memory(cpu)
    assert fraction % 256 == 0 and total * 0.001 - 256 < fraction <= total * 0.001
    with pytest.raises(ValueError, match="refit.buffer_fraction=1e-15 gives 0 bytes per buffer"):
        RefitConfig(buffer_fraction=1e-15).resolve_buffer_bytes(cpu)


@pytest.mark.parametrize("data, message", [
    ({"mode": "colo"},
     "config key 'refit.mode' must be one of 'colocated', 'non_colocated', got 'colo'"),
    ({"buffer_bytes": 1 << 20, "buffer_fraction": 0.1},
     "set only one of refit.buffer_bytes and refit.buffer_fraction, got 1048576 and 0.1"),
    ({"buffer_fraction": 0.0}, "refit.buffer_fraction must be in (0, 1], got 0.0"),
    ({"buffer_fraction": 1.5}, "refit.buffer_fraction must be in (0, 1], got 1.5"),
    ({"buffer_fraction": float("nan")}, "refit.buffer_fraction must be in (0, 1], got nan"),
    ({"buffer_fraction": "half"},
     "config key 'refit.buffer_fraction' must be a number, got 'half'"),
    ({"buffer_bytes": 100}, "refit.buffer_bytes must be an integer ≥ 512, got 100"),
    ({"buffer_bytes": 1.5}, "config key 'refit.buffer_bytes' must be an integer, got 1.5"),
    ({"num_buffers": 0}, "refit.num_buffers must be an integer ≥ 1, got 0"),
    ({"num_buffers": True}, "config key 'refit.num_buffers' must be an integer, got True"),
    ({"alignment_bytes": 8}, "refit.alignment_bytes must be an integer ≥ 16, got 8"),
    ({"alignment_bytes": 48}, "refit.alignment_bytes must be a power of two, got 48"),
    ({"timeout_s": 0}, "refit.timeout_s must be a positive number of seconds, got 0.0"),
    ({"start_timeout_s": -1},
     "refit.start_timeout_s must be a positive number of seconds, got -1.0"),
    ({"checksums": "yes"}, "config key 'refit.checksums' must be true or false, got 'yes'"),
    ({"buffer_size": 10},
     "unknown config key 'refit.buffer_size' (known keys: alignment_bytes, buffer_bytes, "
     "buffer_fraction, checksums, ipc_dir, mode, num_buffers, start_timeout_s, timeout_s, "
     "track_peak_memory)"),
])
def test_invalid_values_name_the_key(data, message):
    with pytest.raises(ValueError) as error:
        from_dict(Job, {"refit": data})
    assert str(error.value) == message
