"""Probe: what does a rank that shares a GPU with the inference rank do to the refit link?

Issue 12's step 1 (profile first). Three processes on two GPUs, as the 3-rank refit placement:
rank 0 = trainer rank 0 (GPU 0, the sender), rank 1 = trainer rank 1 (GPU 1), rank 2 = the
inference rank (GPU 1). Rank 0 broadcasts ``--bytes`` to rank 2 over an NCCL group of the two
while rank 1 does one of:

- ``host_wait``:     waits on the host (a gloo barrier): nothing on GPU 1 but the receiver;
- ``nccl_wait``:     sits in an NCCL receive from rank 0 that rank 0 serves only afterwards
                     (a waiting rank as in today's lockstep and export collectives);
- ``copy_loop``:     copies 256 MiB device-to-device in a loop for 100 ms (packing);
- ``nccl_send``:     sends ``--bytes`` to rank 0 over NCCL (a relay of its own stage);
- ``ipc_pulled``:    idles while rank 0 pulls ``--bytes`` from rank 1's memory over CUDA IPC
                     (a peer copy on GPU 0's copy engine);
- ``ipc_pulled_busy``: the same while rank 1 runs the copy loop.

For each case the median over ``--reps`` of the broadcast's GB/s (timed on rank 0 from start to
the receiver's completion) and of the concurrent transfer's GB/s is printed, one JSON line per
case. A torch-profiler kernel summary of the receiver in the ``host_wait`` and ``nccl_wait`` cases
goes to ``$OUT/profile_<case>.txt``. Finally, whether NCCL accepts a communicator with two ranks on
one GPU (ranks 1 and 2).

    torchrun --nproc-per-node 3 scripts/gpu_probe_shared_gpu.py [--bytes 1073741824] [--reps 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

CASES = ("host_wait", "nccl_wait", "copy_loop", "nccl_send", "ipc_pulled", "ipc_pulled_busy")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=1 << 30)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    assert int(os.environ["WORLD_SIZE"]) == 3, "launch 3 ranks"
    gpu = 0 if rank == 0 else 1
    torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", timeout=timeout)
    link = dist.new_group([0, 2], backend="nccl", timeout=timeout)
    pair = dist.new_group([0, 1], backend="nccl", timeout=timeout)
    payload = torch.ones(args.bytes, dtype=torch.uint8, device=device)
    relay = torch.ones(args.bytes, dtype=torch.uint8, device=device)
    scratch = [torch.ones(256 << 20, dtype=torch.uint8, device=device) for _ in range(2)]
    pulled = _share_relay(rank, relay, device)
    # Warm both NCCL groups.
    if rank in (0, 2):
        dist.broadcast(payload, src=0, group=link)
    if rank in (0, 1):
        dist.broadcast(relay, src=1, group=pair)
    torch.cuda.synchronize()
    out = os.environ.get("OUT", ".")
    for case in CASES:
        results = []
        # Rep 0 warms up, reps 1..reps are timed, one more runs under the profiler.
        for rep in range(args.reps + 2):
            profile = rep == args.reps + 1 and case in ("host_wait", "nccl_wait") and rank in (1, 2)
            results.append(_one(case, rank, payload, relay, pulled, scratch, link, pair,
                                profile=profile, out=out))
        if rank == 0:
            timed = results[1:args.reps + 1]
            line = {"case": case, "bytes": args.bytes,
                    "broadcast_gbps": round(statistics.median(r[0] for r in timed), 1)}
            if timed[0][1] is not None:
                line["concurrent_gbps"] = round(statistics.median(r[1] for r in timed), 1)
            print(json.dumps(line), flush=True)
    _duplicate_gpu_check(rank)
    dist.destroy_process_group()


def _share_relay(rank: int, relay: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """Rank 0 maps rank 1's relay buffer through CUDA IPC (the handle travels over gloo)."""
    from torch.multiprocessing.reductions import reduce_tensor

    handle = [reduce_tensor(relay)[1] if rank == 1 else None]
    dist.broadcast_object_list(handle, src=1)
    if rank != 0:
        return None
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*handle[0])


def _one(case, rank, payload, relay, pulled, scratch, link, pair, *, profile, out):
    dist.barrier()
    torch.cuda.synchronize()
    profiler = None
    if profile:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                      torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    start = time.perf_counter()
    broadcast_s = concurrent_s = None
    if rank == 0:
        if case in ("ipc_pulled", "ipc_pulled_busy"):
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                pull_start = time.perf_counter()
                relay.copy_(pulled, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
        if case == "nccl_send":
            recv = dist.irecv(relay, src=1, group=pair)
            pull_start = time.perf_counter()
        dist.broadcast(payload, src=0, group=link)
        torch.cuda.synchronize()
        broadcast_s = time.perf_counter() - start
        if case in ("ipc_pulled", "ipc_pulled_busy"):
            done.synchronize()
            concurrent_s = time.perf_counter() - pull_start
        if case == "nccl_send":
            recv.wait()
            torch.cuda.synchronize()
            concurrent_s = time.perf_counter() - pull_start
        if case == "nccl_wait":
            dist.send(payload[:8], dst=1, group=pair)  # release rank 1's waiting receive
    elif rank == 2:
        dist.broadcast(payload, src=0, group=link)
        torch.cuda.synchronize()
    else:
        busy = case in ("copy_loop", "ipc_pulled_busy")
        if case == "nccl_wait":
            dist.recv(relay[:8], src=0, group=pair)
        elif case == "nccl_send":
            dist.send(relay, dst=0, group=pair)
        elif busy:
            # Copy for 100 ms: longer than rank 0's broadcast and pull take.
            deadline = time.perf_counter() + 0.1
            while time.perf_counter() < deadline:
                scratch[0].copy_(scratch[1])
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    if profiler is not None:
        torch.cuda.synchronize()
        profiler.__exit__(None, None, None)
        table = profiler.key_averages().table(sort_by="cuda_time_total", row_limit=15)
        with open(os.path.join(out, f"profile_{case}_rank{rank}.txt"), "w") as handle:
            handle.write(table)
    seconds = [broadcast_s, concurrent_s]
    nbytes = payload.numel()
    return tuple(nbytes / s / 1e9 if s else None for s in seconds)


def _duplicate_gpu_check(rank: int) -> None:
    """Does NCCL accept ranks 1 and 2 (both on GPU 1) in one communicator?"""
    verdict = "not tried"
    try:
        group = dist.new_group([1, 2], backend="nccl",
                               timeout=datetime.timedelta(seconds=30))
        if rank in (1, 2):
            value = torch.ones(1, device="cuda")
            dist.all_reduce(value, group=group)
            torch.cuda.synchronize()
            verdict = f"ok (sum {value.item()})"
    except Exception as error:  # noqa: BLE001 - the probe reports whatever NCCL says
        verdict = f"{type(error).__name__}: {str(error)[:300]}"
    if rank in (1, 2):
        print(json.dumps({"duplicate_gpu_communicator": verdict, "rank": rank}), flush=True)


if __name__ == "__main__":
    main()
