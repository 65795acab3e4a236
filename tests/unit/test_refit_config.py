"""RefitConfig validation: every bad value gets an error naming its full key; slot size
semantics; the flat keys of before the plan/transport split name their new place."""

from dataclasses import dataclass, field

import pytest
import torch

from mcore_refit.config import from_dict, load_config
from mcore_refit.refit import PlanConfig, RefitConfig, TransportOptions
from mcore_refit.refit.config import DEFAULT_SLOT_BYTES, total_device_memory


@dataclass(frozen=True, kw_only=True)
class Job:
    refit: RefitConfig = field(default_factory=RefitConfig)


def test_defaults():
    config = RefitConfig()
    assert config.mode == "non_colocated" and config.plan.num_slots == 2
    assert config.plan.resolve_slot_bytes(torch.device("cpu")) == DEFAULT_SLOT_BYTES
    assert config.transport == TransportOptions()


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "refit.yaml"
    path.write_text("refit:\n  mode: colocated\n  plan:\n    slot_bytes: 4096\n"
                    "  transport:\n    checksums: true\n")
    job = load_config(Job, path, ["refit.plan.num_slots=3", "refit.transport.timeout_s=2.5"])
    assert job.refit == RefitConfig(mode="colocated",
                                    plan=PlanConfig(slot_bytes=4096, num_slots=3),
                                    transport=TransportOptions(checksums=True, timeout_s=2.5))


def test_every_fanout_loads():
    for fanout in ("broadcast", "relay", "direct"):
        job = load_config(Job, None, [f"refit.transport.fanout={fanout}"])
        assert job.refit.transport.fanout == fanout


def test_slot_size_semantics():
    cpu = torch.device("cpu")
    assert PlanConfig(slot_bytes=1000 * 256 + 17).resolve_slot_bytes(cpu) == 1000 * 256
    fraction = PlanConfig(slot_fraction=0.001).resolve_slot_bytes(cpu)
    total = total_device_memory(cpu)
    assert fraction % 256 == 0 and total * 0.001 - 256 < fraction <= total * 0.001
    with pytest.raises(ValueError, match="slot_fraction=1e-15 gives 0 bytes per slot"):
        PlanConfig(slot_fraction=1e-15).resolve_slot_bytes(cpu)


@pytest.mark.parametrize("data, message", [
    ({"mode": "colo"},
     "config key 'refit.mode' must be one of 'colocated', 'non_colocated', got 'colo'"),
    ({"plan": {"slot_bytes": 1 << 20, "slot_fraction": 0.1}},
     "set only one of refit.plan.slot_bytes and refit.plan.slot_fraction, got 1048576 and 0.1"),
    ({"plan": {"slot_fraction": 0.0}}, "refit.plan.slot_fraction must be in (0, 1], got 0.0"),
    ({"plan": {"slot_fraction": 1.5}}, "refit.plan.slot_fraction must be in (0, 1], got 1.5"),
    ({"plan": {"slot_fraction": float("nan")}},
     "refit.plan.slot_fraction must be in (0, 1], got nan"),
    ({"plan": {"slot_fraction": "half"}},
     "config key 'refit.plan.slot_fraction' must be a number, got 'half'"),
    ({"plan": {"slot_bytes": 100}}, "refit.plan.slot_bytes must be an integer ≥ 512, got 100"),
    ({"plan": {"slot_bytes": 1.5}},
     "config key 'refit.plan.slot_bytes' must be an integer, got 1.5"),
    ({"plan": {"num_slots": 0}}, "refit.plan.num_slots must be an integer ≥ 1, got 0"),
    ({"plan": {"num_slots": True}},
     "config key 'refit.plan.num_slots' must be an integer, got True"),
    ({"plan": {"alignment_bytes": 8}},
     "refit.plan.alignment_bytes must be an integer ≥ 16, got 8"),
    ({"plan": {"alignment_bytes": 48}},
     "refit.plan.alignment_bytes must be a power of two, got 48"),
    ({"transport": {"timeout_s": 0}},
     "refit.transport.timeout_s must be a positive number of seconds, got 0.0"),
    ({"transport": {"start_timeout_s": -1}},
     "refit.transport.start_timeout_s must be a positive number of seconds, got -1.0"),
    ({"transport": {"checksums": "yes"}},
     "config key 'refit.transport.checksums' must be true or false, got 'yes'"),
    ({"transport": {"fanout": "tree"}},
     "config key 'refit.transport.fanout' must be one of 'broadcast', 'relay', 'direct', "
     "got 'tree'"),
    ({"plan": {"slot_size": 10}},
     "unknown config key 'refit.plan.slot_size' (known keys: alignment_bytes, num_slots, "
     "slot_bytes, slot_fraction)"),
])
def test_invalid_values_name_the_key(data, message):
    with pytest.raises(ValueError) as error:
        from_dict(Job, {"refit": data})
    assert str(error.value) == message


@pytest.mark.parametrize("old, new", [
    ("buffer_bytes", "refit.plan.slot_bytes"), ("buffer_fraction", "refit.plan.slot_fraction"),
    ("num_buffers", "refit.plan.num_slots"), ("alignment_bytes", "refit.plan.alignment_bytes"),
    ("timeout_s", "refit.transport.timeout_s"), ("checksums", "refit.transport.checksums"),
    ("start_timeout_s", "refit.transport.start_timeout_s"),
    ("ipc_dir", "refit.transport.ipc_dir"),
    ("track_peak_memory", "refit.transport.track_peak_memory"),
])
def test_old_flat_keys_name_their_new_place(old, new):
    with pytest.raises(ValueError) as error:
        from_dict(Job, {"refit": {old: 1}})
    assert str(error.value) == f"config key 'refit.{old}' was renamed '{new}'"
