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
from typing import TYPE_CHECKING

# Only the standard library before the stop signals are taken over (torch takes seconds to
# import): an interrupt during the start-up ends the rank at once.
from mcore_refit.interrupts import StopSignals
from mcore_refit.launch import LaunchError, TorchrunRanks
from mcore_refit.processes import exit_after

if TYPE_CHECKING:
    from mcore_refit.grpo.config import GRPOJobConfig

LAUNCH = "torchrun --standalone --nproc-per-node N recipes/grpo.py --config configs/X.yaml"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML file (see configs/)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in run.output_dir")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    try:
        ranks = TorchrunRanks.from_environment(os.environ, command=LAUNCH)
    except LaunchError as error:
        parser.error(str(error))
    rank, world_size = ranks.rank, ranks.world_size
    # SIGINT/SIGTERM at any moment: unwind (engines stopped, IPC files removed) within seconds,
    # naming the dead rank when torchrun stops the survivors of a failure, else saying that the
    # run was interrupted; and stop when the torchrun agent dies.
    with StopSignals(announce=rank == 0) as stops:
        from mcore_refit.config import load_config, load_section
        from mcore_refit.grpo.run_config import RunConfig
        from mcore_refit.grpo.runlock import lock_run_directory

        # One writer per run directory: a second run is refused here, from the run section
        # alone, before torch and the rest of the config's modules are imported.
        run = load_section(RunConfig, args.config, args.overrides, "run")
        with lock_run_directory(run.output_dir, rank=rank, job_id=_job_id(ranks)) as run_lock:
            from mcore_refit.grpo import job
            from mcore_refit.grpo.config import GRPOJobConfig
            from mcore_refit.logs import configure_logging

            # A reward module the config names (task.reward: my_pkg.rewards:score) imports
            # from the working directory, as under `python -m`: Python put this script's
            # folder on the path, not the working directory. After that folder, before the
            # installed packages.
            if os.getcwd() not in sys.path:
                sys.path.insert(1, os.getcwd())
            config = load_config(GRPOJobConfig, args.config, args.overrides)
            job.validate_launch(config, world_size=world_size, resume=args.resume,
                                local_world_size=ranks.local_world_size)
            configure_logging(rank=rank,
                              log_file=Path(config.run.output_dir) / "logs" / f"rank{rank}.log")
            run_lock.log_replaced()
            summary = _run(config, ranks, resume=args.resume, stops=stops)
    if rank == 0:
        print(json.dumps(summary), flush=True)
    return 0


def _run(config: GRPOJobConfig, ranks: TorchrunRanks, *, resume: bool,
         stops: StopSignals) -> dict | None:
    from mcore_refit.grpo import job  # imported by main, once the stop signals were taken

    rank, world_size = ranks.rank, ranks.world_size
    if config.refit.mode == "colocated":
        return job.run_colocated(config, rank=rank, world_size=world_size,
                                 local_rank=ranks.local_rank,
                                 local_world_size=ranks.local_world_size,
                                 job_id=_job_id(ranks), resume=resume, stops=stops)
    return job.run_non_colocated(config, rank=rank, world_size=world_size,
                                 local_rank=ranks.local_rank,
                                 local_world_size=ranks.local_world_size, resume=resume,
                                 store_host=ranks.master_addr, store_port=ranks.master_port,
                                 stops=stops)


def _job_id(ranks: TorchrunRanks) -> str:
    """Unique among the jobs running on this host (names the CPU engines' sockets and the run
    directory's lock holder).

    ``--standalone`` gives each launch its own run id; a plain ``torchrun`` leaves
    TORCHELASTIC_RUN_ID at "none", and then the rendezvous port tells concurrent jobs apart.
    """
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'grpo')}-{ranks.master_port}"


if __name__ == "__main__":
    exit_after(lambda: main(sys.argv[1:]))
