"""Bounded calls into users' code: a reward function that never returns ends the run, named.

A Python call cannot be abandoned from outside: a watchdog thread may not raise into a main
thread blocked in C code, and the call may hold locks or half-written state. So a
:class:`CallbackWatchdog` only watches: every call of a function it wraps (:meth:`bound`) starts a
clock; when one has run ``timeout_s`` (``run.callback_timeout_s``), the watchdog prints and logs
which rank, which function and which input, with the main thread's stack in the log, and ends
the process. Its peers then see a dead rank within ``refit.transport.liveness_s`` and fail with
``PeerDied`` naming it; the launcher stops the rest.

A call costs two attribute writes; the watchdog thread wakes every ``timeout_s / 4`` (at most 1 s).
A function that never releases the GIL (a C extension spinning without returning to Python)
also starves the watchdog: such a hang is not caught here.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class CallbackWatchdog:
    """Watches the calls of the functions :meth:`bound` wraps, one at a time (the main thread's).

    ``where`` names this process in the report (``"trainer rank 1"``); ``timeout_s`` None
    watches nothing. ``on_timeout(message)`` runs in the watchdog thread once a call overran:
    by default it reports ``message`` and exits the process (code 1); it should not return.
    """

    def __init__(self, *, timeout_s: float | None, where: str,
                 on_timeout: Callable[[str], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.where = where
        self._on_timeout = on_timeout or _report_and_exit
        self._started: float | None = None
        self._call: tuple[str, tuple] | None = None
        self._main = threading.main_thread().ident
        self._thread: threading.Thread | None = None

    def bound(self, function: Callable, *, name: str) -> Callable:
        """``function``, its calls watched; ``name`` says what it is in the report (``"the
        reward function task.reward='my_pkg.rewards:score'"``)."""
        if self.timeout_s is None:
            return function
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="mcore_refit-callback-watchdog")
            self._thread.start()

        def watched(*args: Any) -> Any:
            self._call = (name, args)
            self._started = time.monotonic()
            try:
                return function(*args)
            finally:
                self._started = None

        return watched

    def _watch(self) -> None:
        interval = min(1.0, self.timeout_s / 4)
        while True:
            time.sleep(interval)
            started, call = self._started, self._call
            if started is None or time.monotonic() - started < self.timeout_s:
                continue
            if self._started is not started:  # it returned meanwhile
                continue
            name, args = call
            inputs = ", ".join(_short(arg) for arg in args)
            message = (f"{self.where}: {name} did not return within {self.timeout_s:g} s "
                       f"(run.callback_timeout_s), called with ({inputs}); this rank exits")
            # The log file gets where the call is stuck; the terminal, one line (on_timeout).
            frame = sys._current_frames().get(self._main)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "unknown"
            logger.info("CallbackTimeout: %s; where it is:\n%s", message, stack)
            self._on_timeout(message)
            return


def _report_and_exit(message: str) -> None:
    print(f"CallbackTimeout: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    logging.shutdown()
    os._exit(1)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."
