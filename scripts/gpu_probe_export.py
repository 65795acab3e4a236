"""Where the trainer-only export pass spends its time, per rank (torchrun; TP1 on 1 rank, TP2 or
PP2 on 2): the Megatron Llama-3-8B preset, random bf16 weights, the bench's plan.

    torchrun --nproc-per-node 2 scripts/gpu_probe_export.py megatron.parallel.tensor=2

Prints one JSON line per rank: medians (µs) over 30 repetitions of the pass's parts — the
control group's agreement on replaced parameters (``begin``), pulling this rank's views
(``own``), the whole pass as the bench times it (``pass``), and a bare gloo all-gather and
barrier for scale.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from mcore_refit import distributed
from mcore_refit.bench.config import RefitBenchJob
from mcore_refit.bench.sources import build_megatron, export_pass
from mcore_refit.config import load_config
from mcore_refit.control import ControlGroup
from mcore_refit.refit import plan_for_source
from mcore_refit.refit.export import ModelExport

REPETITIONS = 30


def median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def timed(once, synchronize) -> list[float]:
    samples = []
    for _ in range(REPETITIONS):
        synchronize()
        started = time.perf_counter()
        once()
        synchronize()
        samples.append(time.perf_counter() - started)
    return samples


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    context = distributed.init_distributed(rank=rank, world_size=world,
                                           local_rank=int(os.environ["LOCAL_RANK"]))
    job = load_config(RefitBenchJob, os.environ.get("CONFIG", "configs/refit_bench.yaml"),
                      ["bench.source=megatron", "bench.modes=[export_alone]", *sys.argv[1:]])
    control = ControlGroup(context.control_group, timeout_s=60, name="probe")
    model = build_megatron(job.megatron, device=context.device)
    source = ModelExport(model, control=control, device=context.device)
    plan = plan_for_source(source, config=job.refit.plan, device=context.device)

    def synchronize():
        if context.is_cuda:
            torch.cuda.synchronize(context.device)

    def own():
        refit_pass = source.begin(plan)
        for _ in refit_pass.own_weights():
            pass

    results = {
        "rank": rank,
        "layout": {"tp": job.megatron.parallel.tensor, "pp": job.megatron.parallel.pipeline},
        "own_tensors": len(list(source.begin(plan).own_weights())),
        "begin_us": median_us(timed(lambda: source.begin(plan), synchronize)),
        "own_us": median_us(timed(own, synchronize)),
        "pass_us": median_us(timed(lambda: export_pass(source, plan, rank=rank, timeout_s=60),
                                   synchronize)),
        "gather_us": median_us(timed(lambda: control.all_gather_json(False, what="probe"),
                                     synchronize)),
        "barrier_us": median_us(timed(lambda: control.barrier(what="probe"), synchronize)),
    }
    print(json.dumps(results), flush=True)
    if os.environ.get("PROFILE") and rank == 0:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.runcall(lambda: [export_pass(source, plan, rank=rank, timeout_s=60)
                                 for _ in range(REPETITIONS)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    else:
        for _ in range(REPETITIONS):
            export_pass(source, plan, rank=rank, timeout_s=60)
    dist.barrier(group=context.control_group)
    distributed.shutdown()


if __name__ == "__main__":
    main()
