"""Is a peer process still alive? Process identities that survive pid reuse, and SIGTERM.

A :class:`ProcessIdentity` is a process's host, pid and start time (``/proc/<pid>/stat``, field
22, in clock ticks since boot): a pid that was reused by a new process has another start time,
so a dead process is never mistaken for a live one. Other hosts' processes cannot be checked
from here; :meth:`ProcessIdentity.gone` answers None for them (unknown), and the caller relies on
its connection to that peer breaking.

A stop signal becomes an exception (see :mod:`mcore_refit.interrupts`), so a rank unwinds —
closes its engine, removes its IPC files, reports what it knows — instead of vanishing:
:class:`Terminated` when the launcher stops the survivors of a failure, :class:`Interrupted`
when nothing failed. :func:`exit_after` then ends the rank at once.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn


class Terminated(BaseException):
    """This process was asked to stop by a signal: the launcher's SIGTERM once another rank of
    the job failed, or, as the subclass :class:`Interrupted`, a stop with no failure behind it.

    A ``BaseException``: it passes ``except Exception`` handlers that would otherwise report it
    as the failure of whatever was running.
    """


class Interrupted(Terminated):
    """This process was stopped though nothing had failed: the user's SIGINT or SIGTERM, or its
    launcher's death. Not a failure of the job: the process exits with ``128 + signum`` and one
    line saying so, no traceback."""

    def __init__(self, message: str, *, signum: int) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@dataclass(frozen=True)
class ProcessIdentity:
    """One process: ``host``, ``pid`` and ``start_time`` (None where ``/proc`` is missing)."""

    host: str
    pid: int
    start_time: int | None

    @classmethod
    def of(cls, pid: int | None = None) -> ProcessIdentity:
        """The identity of process ``pid`` on this host (this process by default)."""
        pid = os.getpid() if pid is None else pid
        return cls(host=socket.gethostname(), pid=pid, start_time=start_time(pid))

    def to_json(self) -> dict:
        return {"host": self.host, "pid": self.pid, "start_time": self.start_time}

    @classmethod
    def from_json(cls, data: dict) -> ProcessIdentity:
        start = data.get("start_time")
        if (not isinstance(data.get("host"), str) or not _is_int(data.get("pid"))
                or not (start is None or _is_int(start))):
            raise ValueError(f"malformed process identity: {data!r:.200}")
        return cls(host=data["host"], pid=data["pid"], start_time=start)

    def gone(self) -> bool | None:
        """True once the process has exited (or is a zombie), False while it runs, None when
        it runs on another host (unknown here)."""
        if self.host != socket.gethostname():
            return None
        return not pid_running(self.pid, start_time=self.start_time)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot; None if it is gone or this
    system has no ``/proc``."""
    try:
        return int(_stat_fields(pid)[19])
    except OSError:
        return None


def pid_running(pid: int, *, start_time: int | None = None) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie; with ``start_time``,
    also that it is the process that started then (not a later one that reused the pid)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        fields = _stat_fields(pid)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /proc: the signal probe above is all we know
    if fields[0] in (b"Z", b"X"):
        return False
    return start_time is None or int(fields[19]) == start_time


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        data = stat.read()
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    return data[data.rindex(b")") + 2:].split()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class PeerWatch:
    """The other processes of a job — ``(rank, name, identity)``, the name errors give it
    (``"trainer rank 1"``) — checked every ``interval_s`` by the waits that take this watch."""

    peers: tuple[tuple[int, str, ProcessIdentity], ...]
    interval_s: float

    def among(self, ranks) -> PeerWatch:
        """The watch over ``ranks`` only (the members of a smaller group): a process that is
        not a member may end without breaking that group's waits."""
        ranks = set(ranks)
        return PeerWatch(peers=tuple(p for p in self.peers if p[0] in ranks),
                         interval_s=self.interval_s)

    def first_dead(self, *, grace_s: float = 0.0) -> str | None:
        """``"<name> (pid N on host) died"`` for the first peer found gone, else None; with
        ``grace_s``, keep looking that long (a peer whose connection just broke may still be
        on its way out)."""
        deadline = time.monotonic() + grace_s
        while True:
            for _, name, identity in self.peers:
                if identity.gone():
                    return f"{name} ({identity.describe()}) died"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


def root_failure(error: BaseException) -> BaseException:
    """``error``, or the failure a :class:`Terminated` interrupted while this rank unwound from
    it (what the rank reports; its traceback prints that failure first too)."""
    while isinstance(error, Terminated) and error.__context__ is not None:
        error = error.__context__
    return error


def exit_after(main: Callable[[], int]) -> NoReturn:
    """Run ``main`` as a process's entry point and exit with its code. If it raises, print the
    traceback and leave at once (``os._exit``): a failed rank skips the interpreter's clean-up
    (seconds of module teardown, destructors of process groups whose peers are gone), so the
    launcher sees the failure, and stops the other ranks, without delay. An
    :class:`Interrupted` (reported where it was raised) leaves without a traceback, with
    ``128 + signum``."""
    try:
        code = main()
    except SystemExit:
        raise
    except Interrupted as interrupted:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(interrupted.exit_code)
    except BaseException:
        # The report comes first: the launcher's SIGTERM after this failure (or another rank's)
        # may arrive while the traceback is being formatted, after the stop signals' handlers
        # are gone, and would end the process without a line. It is leaving anyway.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(1)
    # What main left in reference cycles (a model and its optimizer) is freed while the process
    # is whole: CUDA memory it shared with an engine that has since let go (the weights, read in
    # place) is then returned before torch's exit check, which would report it as still shared.
    gc.collect()
    sys.exit(code)
