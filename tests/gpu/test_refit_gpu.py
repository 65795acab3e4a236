"""Refit transports on GPUs: bitwise round trips and no device allocation after the first refit.

- non-colocated: GPU0 → GPU1 over NCCL (two spawned ranks);
- colocated: trainer in this process on GPU0, engine in a spawned process on GPU0 (CUDA IPC).

The allocator's counters (``allocation.all.allocated``, ``segment.all.allocated``,
``num_alloc_retries``) must not move during a steady-state refit, on either side.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mcore_refit.bench.synthetic import SyntheticWeightSource, tiny_mixed_specs
from mcore_refit.control import ControlGroup
from mcore_refit.refit import (
    ColocatedInitInfo,
    LocalSource,
    NonColocatedInitInfo,
    NonColocatedSender,
    Placement,
    PlanConfig,
    Refitter,
    TensorDictEngine,
    TensorSpec,
    TransportOptions,
    WeightTransferEndpoint,
    create_sender,
    plan_for_source,
    transport_for,
)
from tests.tensors import bits

pytestmark = [pytest.mark.gpu]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
one_gpu = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")

SEED = 3
COUNTERS = ("allocation.all.allocated", "segment.all.allocated", "num_alloc_retries")


def gpu_specs() -> list[TensorSpec]:
    """~190 MB mixing dtypes, odd shapes, a 0-dim, an empty and a 32 MB (oversized) tensor."""
    specs = list(tiny_mixed_specs())
    for layer in range(40):
        specs += [TensorSpec(f"blocks.{layer}.w", (1024, 1024 + layer), torch.bfloat16),
                  TensorSpec(f"blocks.{layer}.norm", (1024 + layer,), torch.float32)]
    specs += [TensorSpec("big.w", (4096, 4096), torch.bfloat16),
              TensorSpec("big.ids", (333,), torch.int64),
              TensorSpec("big.half", (1000, 513), torch.float16)]
    return specs


PLAN = PlanConfig(slot_bytes=16 << 20, num_slots=2)


def options(**overrides) -> TransportOptions:
    values = {"checksums": False, "timeout_s": 120.0, "start_timeout_s": 300.0}
    return TransportOptions(**{**values, **overrides})


def counters(device: torch.device) -> dict[str, int]:
    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    return {key: stats.get(key, 0) for key in COUNTERS}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in COUNTERS}



# --- non-colocated: two spawned NCCL ranks --------------------------------------------------


def _nccl_entry(rank: int, port: int, out_dir: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=300),
                            device_id=device)
    try:
        result = _broadcast_scenario(rank, device)
    except BaseException as error:
        result = {"uncaught": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc()}
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _broadcast_scenario(rank: int, device: torch.device) -> dict:
    specs = gpu_specs()
    placement = Placement(num_trainers=1, num_receivers=1, shared=frozenset())
    control = ControlGroup(dist.new_group(backend="gloo"), timeout_s=120)
    data_group = dist.new_group([0, 1])
    out: dict = {}
    if rank == 0:
        source = LocalSource(SyntheticWeightSource(specs, device=device, seed=SEED,
                                                   noncontiguous=True))
        for name, transport in (("plain", options()), ("checksums", options(checksums=True))):
            plan = plan_for_source(source, config=PLAN, device=device)
            sender = NonColocatedSender(plan=plan, placement=placement, rank=0, control=control,
                                     data_group=data_group, device=device, options=transport)
            with Refitter(source=source, sender=sender) as refitter:
                refitter.prepare()
                first = refitter.refit(verify=True)
                before = counters(device)
                second = refitter.refit()
                after = counters(device)
            out[name] = {"first": first.as_dict(), "second": second.as_dict(),
                         "delta": delta(before, after), "held": plan.held_bytes,
                         "oversized": sum(b.oversized for b in plan.buffers)}
        # An independent bitwise check: every source tensor once more, one broadcast each.
        for _, tensor in source.source.iter_weights():
            dist.broadcast(tensor.contiguous(), group_src=0)
        return out
    engine = TensorDictEngine.from_specs(specs, device=device)
    for name, transport in (("plain", options()), ("checksums", options(checksums=True))):
        with WeightTransferEndpoint(engine=engine, device=device, options=transport) as endpoint:
            endpoint.init_weight_transfer_engine(NonColocatedInitInfo(
                placement=placement, receiver=0, control=control, data_groups={0: data_group}))
            endpoint.start_weight_update()
            first = endpoint.update_weights()
            endpoint.finish_weight_update(1)
            before = counters(device)
            endpoint.start_weight_update()
            second = endpoint.update_weights()
            endpoint.finish_weight_update(2)
            after = counters(device)
        out[name] = {"first": first.as_dict(), "second": second.as_dict(),
                     "delta": delta(before, after)}
    mismatched = []
    for spec in specs:
        expected = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        dist.broadcast(expected, group_src=0)
        if not torch.equal(bits(engine.get_weight(spec.name)), bits(expected)):
            mismatched.append(spec.name)
    out["mismatched"] = mismatched
    return out


@two_gpus
@pytest.mark.timeout(300)
def test_broadcast_gpu0_to_gpu1_bitwise_without_new_allocations(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.start_processes(_nccl_entry, args=(port, str(tmp_path)), nprocs=2,
                                 start_method="spawn", join=False)
    deadline = time.monotonic() + 280
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        assert time.monotonic() < deadline, "the ranks did not finish"
    sender = json.loads((tmp_path / "0.json").read_text())
    receiver = json.loads((tmp_path / "1.json").read_text())
    assert "uncaught" not in sender and "uncaught" not in receiver, (sender, receiver)
    assert receiver["mismatched"] == []
    for name in ("plain", "checksums"):
        sent, received = sender[name], receiver[name]
        assert sent["oversized"] >= 1
        assert sent["first"]["verified"] is True and received["first"]["verified"] is True
        assert received["second"]["refit_index"] == 1
        for side in (sent, received):
            assert side["delta"]["segment.all.allocated"] == 0, (name, side["delta"])
            assert side["delta"]["num_alloc_retries"] == 0, (name, side["delta"])
            assert side["second"]["new_segments"] == 0
        assert sent["second"]["pack_s"] > 0 and sent["second"]["transfer_s"] > 0
        assert received["second"]["load_s"] > 0
        assert sent["second"]["checksums"] is received["second"]["checksums"] is \
            (name == "checksums")
    # Without checksums nothing at all is allocated, not even from the allocator's cache, and
    # the buffers are the only extra memory (the source's tensors are resident).
    for side in (sender["plain"], receiver["plain"]):
        assert side["delta"]["allocation.all.allocated"] == 0, side["delta"]
        assert side["second"]["new_allocations"] == 0
    assert sender["plain"]["second"]["peak_extra_bytes"] == sender["plain"]["held"]


# --- colocated: the engine in a spawned process on the same GPU ----------------------------


def _engine_main(address: str, out_path: str) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    try:
        specs = gpu_specs()
        engine = TensorDictEngine.from_specs(specs, device=device)
        with WeightTransferEndpoint(engine=engine, device=device,
                                    options=options()) as endpoint:
            endpoint.init_weight_transfer_engine(ColocatedInitInfo(address=address))
            endpoint.start_weight_update()
            first = endpoint.update_weights()
            endpoint.finish_weight_update(1)
            before = counters(device)
            endpoint.start_weight_update()
            second = endpoint.update_weights()
            endpoint.finish_weight_update(2)
            after = counters(device)
        expected = SyntheticWeightSource(specs, device=device, seed=SEED, noncontiguous=True)
        mismatched = [n for n, t in expected.iter_weights()
                      if not torch.equal(bits(engine.get_weight(n)), bits(t))]
        result = {"first": first.as_dict(), "second": second.as_dict(),
                  "delta": delta(before, after), "mismatched": mismatched}
    except BaseException as error:
        result = {"uncaught": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc()}
    Path(out_path).write_text(json.dumps(result))


@one_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharing", ["buffers", "weights"])
def test_colocated_cuda_ipc_bitwise_without_new_allocations(tmp_path, ipc_dir, sharing):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    transport = dataclasses.replace(options(ipc_dir=ipc_dir), ipc_sharing=sharing)
    source = LocalSource(SyntheticWeightSource(gpu_specs(), device=device, seed=SEED,
                                               noncontiguous=True))
    plan = plan_for_source(source, config=PLAN, device=device)
    sender = create_sender(transport_for("colocated", transport), plan=plan, device=device,
                           options=transport)
    assert "GPU-" in sender.address
    engine_out = tmp_path / "engine.json"
    engine = mp.get_context("spawn").Process(target=_engine_main,
                                             args=(sender.address, str(engine_out)))
    engine.start()
    with Refitter(source=source, sender=sender) as refitter:
        refitter.prepare()
        first = refitter.refit(verify=True)
        before = counters(device)
        second = refitter.refit()
        after = counters(device)
    engine.join(120)
    assert not engine.is_alive()
    received = json.loads(engine_out.read_text())
    assert "uncaught" not in received, received
    assert received["mismatched"] == []
    assert first.verified is True and received["first"]["verified"] is True
    for side in (delta(before, after), received["delta"]):
        assert side == {key: 0 for key in COUNTERS}, side
    assert second.new_allocations == 0 and second.new_segments == 0
    assert received["second"]["new_allocations"] == 0 and received["second"]["load_s"] > 0
    if sharing == "buffers":
        assert second.peak_extra_bytes == plan.held_bytes and second.pack_s > 0
    else:  # the engine reads the source's tensors in place: nothing held, nothing packed
        assert second.peak_extra_bytes == second.held_bytes == 0 and second.pack_s == 0
