"""GRPO with the refit engine in the loop, colocated or non-colocated.

    torchrun --standalone --nproc-per-node N recipes/grpo.py --config configs/X.yaml \
        [key=value ...] [--resume]

--standalone lets torchrun pick a free port, so several jobs share a host; a multi-node launch
runs one agent per node with --nnodes, --node-rank and a common --master-addr/--master-port.

Colocated (refit.mode: colocated): every rank trains and spawns an inference engine on its own
device. Non-colocated: the last inference.num_ranks ranks serve inference on their own devices.
The last line of stdout (global rank 0) is the run's summary as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mcore_refit.config import load_config
from mcore_refit.grpo import job
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.logs import configure_logging
from mcore_refit.processes import exit_after, stop_on_sigterm


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML file (see configs/)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in run.output_dir")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)

    config = load_config(GRPOJobConfig, args.config, args.overrides)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    configure_logging(rank=rank, log_file=Path(config.run.output_dir) / "logs" / f"rank{rank}.log")
    # Each node's own ranks: they pick the GPUs of their node (multi-node launches too).
    local = dict(local_rank=int(os.environ["LOCAL_RANK"]),
                 local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]))
    # torchrun stops every rank with SIGTERM once one failed: unwind (engines stopped, IPC files
    # removed) and name the dead rank, rather than vanish.
    with stop_on_sigterm():
        if config.refit.mode == "colocated":
            summary = job.run_colocated(config, rank=rank, world_size=world_size, **local,
                                        job_id=_job_id(), resume=args.resume)
        else:
            summary = job.run_non_colocated(config, rank=rank, world_size=world_size, **local,
                                            resume=args.resume,
                                            store_host=os.environ["MASTER_ADDR"],
                                            store_port=int(os.environ["MASTER_PORT"]))
    if rank == 0:
        print(json.dumps(summary), flush=True)
    return 0


def _job_id() -> str:
    """Unique among the jobs running on this host (names the CPU engines' sockets).

    ``--standalone`` gives each launch its own run id; a plain ``torchrun`` leaves
    TORCHELASTIC_RUN_ID at "none", and then the rendezvous port tells concurrent jobs apart.
    """
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'grpo')}-{os.environ['MASTER_PORT']}"


if __name__ == "__main__":
    exit_after(lambda: main(sys.argv[1:]))
