"""torchrun --nproc-per-node N grpo_kill_in_save.py --kill-at STEP --marker FILE -- RECIPE_ARGS

Runs ``recipes/grpo.py`` with RECIPE_ARGS and SIGKILLs global rank 0 in the middle of saving the
checkpoint of step STEP: once every trainer rank has written its shards under the checkpoint's
temporary name, before the rename that makes it the latest. Rank 0 writes the time of the kill
(``time.time()``) to FILE just before it.
"""

import argparse
import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch

from mcore_refit.policy import checkpoint

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "grpo.py"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-at", type=int, required=True)
    parser.add_argument("--marker", type=Path, required=True)
    parser.add_argument("recipe_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    save = checkpoint.save_checkpoint

    def save_then_die(path, *, step, **kwargs):
        save(path, step=step, **kwargs)
        if step == args.kill_at and int(os.environ["RANK"]) == 0:
            args.marker.write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.save_checkpoint = save_then_die
    recipe_args = args.recipe_args[1:] if args.recipe_args[:1] == ["--"] else args.recipe_args
    sys.argv = [str(RECIPE), *recipe_args]
    runpy.run_path(str(RECIPE), run_name="__main__")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
