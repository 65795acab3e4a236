"""Logging for the recipes: INFO lines to a log file per rank, only what needs a reader to the
terminal.

Our loggers (``mcore_refit.*``) reach the terminal from WARNING up; third-party libraries (their
records, and Python warnings) from ERROR up, so their start-up chatter stays in the log file.
Installing a root handler first also turns a later ``logging.basicConfig`` into a no-op, which
``megatron.training`` calls when imported (INFO lines on stdout otherwise). torch and transformers
attach stderr handlers of their own and stop propagation; :func:`configure_logging` removes those,
so their records follow the same rule. What a library prints instead of logging (Megatron-Bridge:
a traceback at import, parameter counts and a progress bar while it builds the model) is captured
into the log with :func:`output_to_log` where we call it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

FORMAT = "%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"
_arguments: dict | None = None
_log = logging.getLogger(__name__)


def logging_arguments() -> dict | None:
    """The keyword arguments of this process's last :func:`configure_logging` call (None before
    one): a spawned child passes them to ``configure_logging`` to log where its parent does."""
    return None if _arguments is None else dict(_arguments)


def configure_logging(*, rank: int, log_file: str | Path | None,
                      console_level: int = logging.WARNING,
                      third_party_console_level: int = logging.ERROR,
                      process: str | None = None) -> None:
    """Route logging: every rank appends INFO and above to ``log_file`` (if given; its folder is
    created); the terminal (stderr) gets the ``mcore_refit`` loggers from ``console_level`` and
    everything else (other libraries, Python warnings) from ``third_party_console_level``. Lines
    name the rank (and ``process``, for a helper process of the rank such as its engine).
    Calling it again replaces the handlers; :func:`logging_arguments` repeats the call in a
    spawned child. Progress bars get a thread lock."""
    global _arguments
    _arguments = {"rank": rank, "log_file": None if log_file is None else str(log_file),
                  "console_level": console_level,
                  "third_party_console_level": third_party_console_level}
    label = f"{rank} {process}" if process else str(rank)
    formatter = logging.Formatter(FORMAT.format(rank=label))
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
    _route_library_loggers()
    lock_progress_bars_within_the_process()


def _route_library_loggers() -> None:
    """Hand the records of torch's and transformers' loggers to the root handlers: both attach
    their own stderr handler and set ``propagate = False`` (torch at import, transformers on its
    first logger), which would put e.g. "No CUDA runtime is found" and "`torch_dtype` is
    deprecated" on the terminal and never in the log file."""
    import transformers.utils.logging as transformers_logging

    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (name == "torch" or name.startswith("torch.")):
            for handler in list(logger.handlers):
                if _writes_to(handler, (sys.stderr, sys.__stderr__)):
                    logger.removeHandler(handler)
            logger.propagate = True


@contextlib.contextmanager
def output_to_log(source: str) -> Iterator[None]:
    """Send what the enclosed code writes to ``sys.stdout``/``sys.stderr`` (``print``, a
    traceback, a progress bar) to the log file as one INFO record naming ``source``, not to the
    terminal. For third-party code that prints instead of logging. A stream handler attached
    meanwhile to the captured stream (a library configuring its logger at import) is removed and
    its logger propagates, so its records, then and later, go where :func:`configure_logging`
    routes them. Our own handlers keep the real stderr, so records and (captured) Python warnings
    raised inside are routed as usual. Output of C code is not captured.
    """
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            yield
    finally:
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            if isinstance(logger, logging.Logger):
                captured = [h for h in logger.handlers if _writes_to(h, (buffer,))]
                for handler in captured:
                    logger.removeHandler(handler)
                if captured:
                    logger.propagate = True
        text = buffer.getvalue().strip()
        if text:
            _log.info("%s printed:\n%s", source, text)


def _writes_to(handler: logging.Handler, streams: tuple) -> bool:
    return (type(handler) is logging.StreamHandler
            and any(handler.stream is stream for stream in streams))


def lock_progress_bars_within_the_process() -> None:
    """Progress bars (ours, transformers' loading bars) lock with a thread lock. tqdm's default
    adds a multiprocessing lock, a named semaphore that only an interpreter's normal exit
    unlinks: a rank or an engine that ends at once (an error, an interrupt, its trainer gone)
    would leave the resource tracker reporting a "leaked semaphore". Neither starts processes
    that draw bars."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
