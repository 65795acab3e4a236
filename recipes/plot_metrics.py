"""Plot a GRPO run: reward (train/eval), refit time and logprob_mult_err per step, as a PNG.

    python recipes/plot_metrics.py RUN_DIR [--out PATH]

Reads RUN_DIR/metrics.jsonl and writes RUN_DIR/metrics.png (or PATH); prints the PNG's path.
The GRPO recipe writes the same picture when a run ends (run.plot).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mcore_refit.grpo.metrics import read_metrics
from mcore_refit.grpo.plot import PLOT_FILE, plot_metrics


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a GRPO run.output_dir")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write the PNG (default RUN_DIR/{PLOT_FILE})")
    parser.add_argument("--title", default=None, help="figure title (default: the run folder)")
    args = parser.parse_args(argv)
    path = plot_metrics(read_metrics(args.run_dir), args.out or args.run_dir / PLOT_FILE,
                        title=args.title or f"GRPO run {args.run_dir}")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
