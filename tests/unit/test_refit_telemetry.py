"""Refit telemetry: the loggable dict, bandwidth and memory fields."""

import json

import torch

from mcore_refit.refit import DeviceMemoryProbe, RefitTelemetry


def test_as_dict_is_json_with_derived_fields():
    telemetry = RefitTelemetry(role="sender", transport="non_colocated", refit_index=3,
                               device="cuda:0", num_tensors=291, num_buffers=16,
                               payload_bytes=16_060_522_496, total_s=0.0501234567,
                               pack_s=0.0123456789, held_bytes=2 << 30)
    telemetry.record_memory({"peak_transient_bytes": 1024, "new_allocations": 0,
                             "new_segments": 0})
    data = json.loads(json.dumps(telemetry.as_dict()))
    assert data["gbps"] == round(16_060_522_496 / 0.0501234567 / 1e9, 3)
    assert data["total_s"] == 0.050123 and data["pack_s"] == 0.012346
    assert data["peak_extra_bytes"] == (2 << 30) + 1024
    assert data["new_allocations"] == 0 and data["verified"] is None
    assert {"export_s", "pack_s", "transfer_s", "load_s", "wait_s", "checksum_s",
            "verify_s"} <= set(data)


def test_memory_fields_are_none_on_cpu():
    probe = DeviceMemoryProbe(torch.device("cpu"), track_peak=True)
    probe.start()
    stats = probe.stop()
    assert stats == {"peak_transient_bytes": None, "new_allocations": None, "new_segments": None}
    telemetry = RefitTelemetry(role="receiver", transport="colocated", refit_index=0, device="cpu",
                               num_tensors=1, num_buffers=1, payload_bytes=8)
    telemetry.record_memory(stats)
    assert telemetry.peak_extra_bytes is None and telemetry.gbps == 0.0
