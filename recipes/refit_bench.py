"""Refit benchmark: how fast do weights move from the trainer into an inference engine?

    # non-colocated: rank 0 trains (GPU0), rank 1 serves inference (GPU1)
    torchrun --nproc-per-node 2 recipes/refit_bench.py --config configs/refit_bench.yaml
    # Megatron Llama-3-8B at PP2 on 2 trainer ranks -> 1 inference rank on GPU1 (3 ranks)
    torchrun --nproc-per-node 3 recipes/refit_bench.py --config configs/refit_bench.yaml \
        bench.source=megatron bench.num_trainer_ranks=2 megatron.parallel.pipeline=2
    # the export paths alone, trainer ranks only
    torchrun --nproc-per-node 2 recipes/refit_bench.py --config configs/refit_bench.yaml \
        bench.source=megatron bench.trainer_only=true bench.num_trainer_ranks=2 \
        megatron.parallel.tensor=2 'bench.modes=[export_alone,bridge_export_alone]'
    # colocated: every rank spawns its engine on its own GPU
    torchrun --nproc-per-node 1 recipes/refit_bench.py --config configs/refit_bench.yaml \
        refit.mode=colocated bench.source=moe_30b_a3b
    # into a vLLM engine, against vLLM's own load of the same tensors (see configs/*vllm*)
    torchrun --nproc-per-node 2 recipes/refit_bench.py --config configs/refit_bench_vllm_cpu.yaml \
        megatron.hf_path=DIR

Overrides are ``section.key=value`` (YAML values); the modes and layouts are described in
:mod:`mcore_refit.bench`. Rank 0 prints one JSON line per mode, then a summary line with the
targets (``bench.targets``); the exit code is 0 only when every verified refit matched bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid

from mcore_refit.bench import RefitBenchJob, run_bench
from mcore_refit.config import load_config
from mcore_refit.inference.vllm import engine as vllm_engine
from mcore_refit.logs import configure_logging


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="YAML config (defaults otherwise)")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    job = load_config(RefitBenchJob, args.config, args.overrides)
    if job.bench.engine == "vllm":
        # vLLM's switches, before anything imports it (the engine processes of a colocated run
        # inherit them): its engine in the receiving process, no usage reports or hub lookups,
        # its records through this process's logging (not a handler of its own on stdout).
        vllm_engine.set_where_unset(vllm_engine.ENVIRONMENT)
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(rank=rank, log_file=None)
    return run_bench(job, rank=rank, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                     local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                     # One launch per port on a host: it names the launch's sockets on CPU.
                     job_id=f"port{os.environ.get('MASTER_PORT', uuid.uuid4().hex[:12])}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
