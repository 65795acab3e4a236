"""Logging for the recipes: the library's INFO lines to a log file, warnings to the terminal."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"


def configure_logging(*, rank: int, log_file: str | Path | None,
                      console_level: int = logging.WARNING) -> None:
    """Route the ``mcore_refit`` loggers: every rank appends INFO and above to ``log_file`` (if
    given; its folder is created), and the terminal (stderr) gets ``console_level`` and above.
    Lines name the rank. Calling it again replaces the handlers."""
    logger = logging.getLogger("mcore_refit")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    formatter = logging.Formatter(FORMAT.format(rank=rank))
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(console_level)
    console.setFormatter(formatter)
    logger.addHandler(console)
    if log_file is not None:
        path = Path(log_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(path, mode="a")
        file_handler.setLevel(logging.INFO)
        file_handler.setFormatter(formatter)
        logger.addHandler(file_handler)
