"""One writer per run directory: an exclusive lock on ``run.output_dir/run.lock``.

    lock = RunLock(output_dir, job=job_id)
    if rank == 0:
        lock.acquire()        # RunDirectoryInUse when another run holds it; seconds, not minutes
    else:
        lock.check()          # refuses when a live process of another launch holds it
    ...                       # the run
    lock.release()            # or let the process end: the kernel releases it

Global rank 0 takes an ``fcntl.flock`` on the file and keeps it for the life of its process;
the kernel drops it when the process dies, however it dies, so a lock is never stale. The file
also holds a record of its holder (host, pid and start time, the launch's job id, since when):
what a refused run names, and what the other ranks read. They lock nothing (a second lock
holder, even for an instant, would make rank 0's attempt fail): they refuse when the record
names a live process on this host from another launch, and otherwise leave the verdict to rank
0. A record left by a holder that died is replaced by the next run, which says so in its log.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from mcore_refit.config import ConfigError
from mcore_refit.processes import ProcessIdentity

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class RunDirectoryInUse(RuntimeError):
    """Another run holds the run directory's lock; the message names the directory and holder."""


@dataclass(frozen=True)
class LockRecord:
    """Who holds (or held) a run directory's lock."""

    holder: ProcessIdentity
    # The launch the holder belongs to (its other ranks read the record and carry on).
    job: str
    since: str

    def to_json(self) -> dict:
        return {"holder": self.holder.to_json(), "job": self.job, "since": self.since}

    @classmethod
    def from_json(cls, data) -> LockRecord:
        if not isinstance(data, dict) or not isinstance(data.get("job"), str) \
                or not isinstance(data.get("since"), str):
            raise ValueError(f"malformed lock record: {data!r:.200}")
        return cls(holder=ProcessIdentity.from_json(data.get("holder")), job=data["job"],
                   since=data["since"])

    def describe(self) -> str:
        return f"pid {self.holder.pid} on host {self.holder.host}, since {self.since}"


class RunLock:
    """The lock of the run directory ``directory`` for the launch ``job`` (module docstring)."""

    def __init__(self, directory: str | Path, *, job: str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.job = job
        self._fd: int | None = None
        # The record of a dead holder that acquire() replaced (for the log).
        self.replaced: LockRecord | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock for this process (global rank 0), creating the directory; raise
        :class:`RunDirectoryInUse` naming the holder when another process has it."""
        check_output_dir(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirectoryInUse(self._in_use(_read_record(self.path, retries=10))) from None
        except BaseException:
            os.close(fd)
            raise
        previous = _read_record(self.path)
        if previous is not None and previous.holder != ProcessIdentity.of():
            self.replaced = previous
        record = LockRecord(holder=ProcessIdentity.of(), job=self.job,
                            since=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        data = json.dumps(record.to_json()).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self._fd = fd

    def check(self) -> None:
        """On the ranks that do not lock: refuse when a live process of another launch on this
        host holds the directory (rank 0's :meth:`acquire` decides every other case)."""
        check_output_dir(self.directory)
        record = _read_record(self.path)
        if record is not None and record.job != self.job and record.holder.gone() is False:
            raise RunDirectoryInUse(self._in_use(record))

    def log_replaced(self) -> None:
        """Say in the log that a dead run's lock record was taken over (once logging is set)."""
        if self.replaced is not None:
            logger.warning("took over the lock of run.output_dir %r from %s, which is no longer "
                           "running (%s)", str(self.directory), self.replaced.describe(),
                           self.path)

    def release(self) -> None:
        """Clear the record and unlock (a finished run leaves nothing to take over)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _in_use(self, record: LockRecord | None) -> str:
        holder = record.describe() if record is not None else "a process whose record is unreadable"
        return (f"run.output_dir {str(self.directory)!r} is in use by another run ({holder}; "
                f"lock file {str(self.path)!r}): wait for it to end, or choose another "
                "run.output_dir")


def lock_run_directory(output_dir: str | Path, *, rank: int, job_id: str) -> RunLock:
    """``output_dir``'s lock for the launch ``job_id``: global rank 0 takes it, the other ranks
    check it. Call on every rank first, before the start-up (torch need not be imported), so
    that a second run on the directory is refused in seconds; global rank 0 holds it until it
    releases or exits."""
    lock = RunLock(output_dir, job=job_id)
    if rank == 0:
        lock.acquire()
    else:
        lock.check()
    return lock


def check_output_dir(directory: Path) -> None:
    """Refuse a ``run.output_dir`` that is not a directory (or cannot become one)."""
    for path in (directory, *directory.parents):
        if path.exists():
            if not path.is_dir():
                what = "is" if path == directory else f"is inside {str(path)!r}, which is"
                raise ConfigError(f"`run.output_dir`={str(directory)!r} {what} a file, not a "
                                  "directory; choose a directory")
            return


def _read_record(path: Path, *, retries: int = 0) -> LockRecord | None:
    """The record in the lock file; None if there is none or it cannot be read (retried a few
    times, 50 ms apart, where a holder may be writing it right now)."""
    for attempt in range(retries + 1):
        try:
            text = path.read_text()
            if text.strip():
                return LockRecord.from_json(json.loads(text))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            pass
        if attempt < retries:
            time.sleep(0.05)
    return None
