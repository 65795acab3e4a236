"""Logging for the recipes: INFO lines to a log file per rank, only what needs a reader to the
terminal.

Our loggers (``mcore_refit.*``) reach the terminal from WARNING up; third-party libraries (their
records, and Python warnings) from ERROR up, so their start-up chatter stays in the log file.
Installing a root handler first also turns a later ``logging.basicConfig`` into a no-op, which
``megatron.training`` calls when imported (INFO lines on stdout otherwise).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"


def configure_logging(*, rank: int, log_file: str | Path | None,
                      console_level: int = logging.WARNING,
                      third_party_console_level: int = logging.ERROR) -> None:
    """Route logging: every rank appends INFO and above to ``log_file`` (if given; its folder is
    created); the terminal (stderr) gets the ``mcore_refit`` loggers from ``console_level`` and
    everything else (other libraries, Python warnings) from ``third_party_console_level``. Lines
    name the rank. Calling it again replaces the handlers."""
    formatter = logging.Formatter(FORMAT.format(rank=rank))
    file_handler = None
    if log_file is not None:
        path = Path(log_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(path, mode="a")
        file_handler.setLevel(logging.INFO)
        file_handler.setFormatter(formatter)
    for name, level in (("mcore_refit", console_level), ("", third_party_console_level)):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            handler.close()
        logger.setLevel(logging.INFO)
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(level)
        console.setFormatter(formatter)
        logger.addHandler(console)
        if file_handler is not None:
            logger.addHandler(file_handler)
    logging.getLogger("mcore_refit").propagate = False
    logging.captureWarnings(True)
