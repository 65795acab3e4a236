"""How a rank stops when it is asked to, in bounded time, and never outlives its launcher.

torchrun starts each rank in a session of its own. It forwards the user's SIGINT or SIGTERM to
every rank's process group (the rank and its engine process), and once a rank failed it stops
the others with SIGTERM. A torchrun agent that is itself killed (``kill -9``, the OOM killer)
sends nothing: its ranks would go on training on their own.

Inside ``with StopSignals(...)`` (stdlib only: enter it before importing torch) both signals
raise in the main thread, and asks the kernel to send SIGTERM once the launcher exits
(``PR_SET_PDEATHSIG`` on Linux; a thread also checks the parent every second). What the signal
means is decided when it arrives, by a thread that wakes on it even while the main thread is
blocked in a C call (``signal.set_wakeup_fd``):

- :class:`~mcore_refit.processes.Terminated` when a peer of the job (see :meth:`watch`) was
  already gone: the launcher is stopping the survivors of a failure, which the job's error
  handler then names (``PeerDied: ...``);
- :class:`~mcore_refit.processes.Interrupted` otherwise (the user's signal, or the launcher's
  death): nothing failed, and the process ends with one line saying so
  (``Interrupted: the run was stopped by SIGINT``), printed by global rank 0 only.

The same thread bounds the unwinding: ``grace_s`` after an interrupt (``FAILURE_GRACE_S`` after
a failure's stop) the process exits (``os._exit``) whatever its main thread is doing, so every
process is gone within seconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass

from mcore_refit.processes import Interrupted, PeerWatch, ProcessIdentity, Terminated

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# From a stop signal to this process's forced exit: enough for a rank to stop its engine and
# remove its IPC files (about a second measured on CPU), well inside the 5 s every process of
# the job must be gone in. After a failure the launcher is alive and waits (30 s before its
# SIGKILL): a survivor gets longer to name the dead rank on a loaded machine.
GRACE_S = 3.0
FAILURE_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class Stop:
    """A stop signal as it arrived: which, when, and what the job looked like then."""

    signum: int
    arrived: float  # time.monotonic()
    launcher_gone: str | None  # "its launcher (pid N on host) died", or None
    dead_peer: str | None  # PeerWatch.first_dead() at arrival
    peers_known: bool  # whether the job's processes were watched yet

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def interrupts(self) -> bool:
        """True when nothing failed: no peer was gone when the signal came (or the launcher
        itself died)."""
        return self.launcher_gone is not None or self.dead_peer is None

    def describe(self) -> str:
        if self.launcher_gone is not None:
            return f"the run was stopped: {self.launcher_gone}"
        if self.signum == signal.SIGTERM and not self.peers_known:
            # torchrun also stops the others this way when a rank fails during the start-up.
            return (f"the run was stopped by {self.name} during its start-up (the user's, or "
                    "the launcher's after another rank failed: that rank prints its error)")
        return f"the run was stopped by {self.name}"


class StopSignals:
    """This process's handling of SIGINT and SIGTERM inside a ``with`` block (main thread only;
    see the module text).

    ``announce``: print the one "interrupted" line on stderr (global rank 0); every process logs
    it. An :class:`Interrupted` leaving the block is reported so;
    :func:`~mcore_refit.processes.exit_after` then ends the process quietly.
    """

    def __init__(self, *, announce: bool, grace_s: float = GRACE_S) -> None:
        self.announce = announce
        self.grace_s = grace_s
        self._launcher = ProcessIdentity.of(os.getppid())
        self._peers: PeerWatch | None = None
        self._watching = False
        self._lock = threading.Lock()
        self._stop: Stop | None = None
        self._raised = False
        self._unwinding = 0  # depth of unwinding() blocks
        self._announced = False
        self._restore: list = []
        self._left = threading.Event()  # the block ended: no forced exit any more

    def __enter__(self) -> StopSignals:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._write_fd = write_fd
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._restore = [(signum, signal.signal(signum, self._handle)) for signum in STOP_SIGNALS]
        self._restore_fd = previous_fd
        threading.Thread(target=self._watch, args=(read_fd,), daemon=True,
                         name="mcore_refit-stop-signals").start()
        exit_with_parent(signal.SIGTERM, parent_pid=self._launcher.pid)
        return self

    def __exit__(self, exc_type, error, traceback) -> None:
        exit_with_parent(0, parent_pid=self._launcher.pid)
        for signum, handler in self._restore:
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._restore_fd)
        os.close(self._write_fd)  # the watcher thread reads EOF and ends
        self._left.set()
        if isinstance(error, Interrupted):
            self._say(f"Interrupted: {error}")

    def watch(self, peers: PeerWatch | None) -> None:
        """Check ``peers`` when a stop signal arrives (a peer already gone: a failure, not an
        interrupt). Call once the job's processes are known."""
        self._peers = peers
        self._watching = True

    @contextlib.contextmanager
    def unwinding(self):
        """The block of a rank that leaves after a failure of its own (closing its engine,
        tearing down its groups): a stop signal arriving inside is recorded, and its forced exit
        armed, but not raised into that work. The failure in flight is what the rank reports.

        The launcher's SIGTERM after another rank exited often comes while a rank unwinds from
        the same failure; raised there, it would cut the clean-up short."""
        self._unwinding += 1
        try:
            yield
        finally:
            self._unwinding -= 1

    @property
    def stop(self) -> Stop | None:
        """The first stop signal, once one arrived."""
        return self._stop

    # --- internals ----------------------------------------------------------------------------

    def _arrived(self, signum: int) -> Stop:
        """The first stop signal's :class:`Stop` (recorded once, by whichever of the watcher
        thread and the main thread's handler sees it first), with the forced exit armed."""
        with self._lock:
            if self._stop is None:
                gone = os.getppid() != self._launcher.pid or self._launcher.gone()
                self._stop = Stop(
                    signum=signum, arrived=time.monotonic(),
                    launcher_gone=(f"its launcher ({self._launcher.describe()}) died"
                                   if gone else None),
                    dead_peer=self._peers.first_dead() if self._peers is not None else None,
                    peers_known=self._watching)
                threading.Thread(target=self._exit_after_grace, daemon=True,
                                 name="mcore_refit-stop-grace").start()
            return self._stop

    def _handle(self, signum, frame) -> None:
        """The main thread's handler: raise once; later signals are ignored while it unwinds
        (the grace bounds that)."""
        stop = self._arrived(signum)
        if self._raised or self._unwinding:
            return
        self._raised = True
        if stop.interrupts:
            raise Interrupted(stop.describe(), signum=stop.signum)
        raise Terminated(f"this rank was stopped by {stop.name} after {stop.dead_peer} (the "
                         "launcher stops every rank once one has failed)")

    def _watch(self, read_fd: int) -> None:
        """Wake on every signal (the wakeup fd's byte), and check the launcher every second."""
        try:
            while True:
                ready, _, _ = select.select([read_fd], [], [], 1.0)
                if ready:
                    data = os.read(read_fd, 64)
                    if not data:  # the block ended
                        return
                    for signum in data:
                        if signum in STOP_SIGNALS:
                            self._arrived(signum)
                elif self._stop is None and os.getppid() != self._launcher.pid:
                    # No parent-death signal on this system, or it came too early: the same.
                    os.kill(os.getpid(), signal.SIGTERM)
        finally:
            os.close(read_fd)

    def _exit_after_grace(self) -> None:
        stop = self._stop
        grace_s = self.grace_s if stop.interrupts else max(self.grace_s, FAILURE_GRACE_S)
        if self._left.wait(grace_s):
            return  # unwound in time: the process ends on its own, at once
        line = (f"Interrupted: {stop.describe()}" if stop.interrupts else
                f"Terminated: stopped by {stop.name} after {stop.dead_peer}")
        self._say(line, suffix=f" (this process did not finish unwinding within "
                               f"{grace_s:g} s and exits now)")
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(128 + stop.signum if stop.interrupts else 1)

    def _say(self, line: str, *, suffix: str = "") -> None:
        """Log ``line`` (and print it, with ``announce``) the first time; later lines with a
        ``suffix`` (the forced exit) are logged only."""
        with self._lock:
            first, self._announced = not self._announced, True
        if first or suffix:
            logger.info("%s%s", line, suffix)
        if first and self.announce:
            print(line, file=sys.stderr, flush=True)


def exit_with_parent(signum: int, *, parent_pid: int) -> None:
    """Ask the kernel to send this process ``signum`` when its parent exits (Linux's
    ``PR_SET_PDEATHSIG``; nothing elsewhere; 0 cancels). If ``parent_pid``, the parent this
    process was started by, is already gone, send it now.

    The kernel sends it when the *thread* that started this process ends: a launcher starts
    its workers from its main thread (torchrun does; so does :class:`EngineProcess`).
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
                logger.warning("prctl(PR_SET_PDEATHSIG) failed: %s",
                               os.strerror(ctypes.get_errno()))
        except (OSError, AttributeError) as error:
            logger.warning("no parent-death signal (%s)", error)
    if signum and os.getppid() != parent_pid:  # it died before the request
        os.kill(os.getpid(), signum)


def run_child(parent_pid: int, target: str, *args) -> None:
    """Entry point of a child process that lives and stops with its parent (``parent_pid``):
    ignore SIGINT and SIGTERM (a launcher signals a rank's whole process group; the parent
    decides when its child stops), die with the parent (SIGKILL), then import ``target``
    (``"package.module:function"``, see :func:`reference`) and call it with ``args``.

    Give it as ``multiprocessing``'s target, with ``args`` that import nothing heavy when
    unpickled: the child imports them before this runs, and a signal then would still act.
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    exit_with_parent(signal.SIGKILL, parent_pid=parent_pid)
    resolve(target)(*args)


def reference(obj) -> str:
    """``"package.module:qualname"`` of a module-level function or class (see :func:`resolve`)."""
    return f"{obj.__module__}:{obj.__qualname__}"


def resolve(name: str):
    """The object a :func:`reference` names, its module imported."""
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
