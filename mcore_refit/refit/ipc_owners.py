"""Who owns the files in the private IPC directory, and removing the files of dead owners.

A trainer end that creates files there — its socket ``<key>.sock`` and, on CPU, its slots
``<key>.slot<N>`` — first claims ``<key>.owner`` (:func:`claim_owner`): a file holding its
process identity (JSON, for people), locked with ``flock`` for as long as the process lives. The
kernel drops the lock when the process ends, however it ends (SIGKILL included), so a lock that
can be taken means the owner is gone, and a reused pid never keeps a dead job's files alive.

:func:`sweep_stale_files` runs at every trainer start-up and removes the files of owners that
are gone. It never touches a live owner's files: only the owner's lock decides. Files without an
owner record (left by versions that wrote none) are removed only when nothing can hold them: a
socket nobody listens on, and slots whose key has neither an owner record nor a listening
socket (such a trainer bound its socket before creating its slots and removed it last). Other
names in the directory (``.weights<N>`` files shared in place, anything else) are left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import socket
import threading
import time
from pathlib import Path

from mcore_refit.processes import ProcessIdentity

logger = logging.getLogger(__name__)

_OWNED = re.compile(
    r"^(?P<key>[A-Za-z0-9][A-Za-z0-9_.-]{0,79})\.(?P<kind>owner|sock|slot[0-9]{1,5})$")
_CLAIM_ATTEMPTS = 50


class OwnerRecord:
    """This process's claim on ``<key>.owner`` (see :func:`claim_owner`); :meth:`release` it
    after removing the files it covers."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove the record and drop the lock (idempotent)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(self._fd).st_ino == os.lstat(self.path).st_ino:
                self.path.unlink()
        os.close(self._fd)
        self._fd = None


def claim_owner(directory: Path, key: str) -> OwnerRecord:
    """Take ``<directory>/<key>.owner`` for this process; ``ValueError`` naming the owner if a
    live process holds it.

    The record is never seen unlocked: a new one is created, locked and written under a
    temporary name, then linked into place (which fails if a record appeared meanwhile); a dead
    owner's record is locked before it is rewritten. So a sweep running at the same moment finds
    either no record or a locked one, never a live claim's file to remove.
    """
    path = directory / f"{key}.owner"
    record = json.dumps({**ProcessIdentity.of().to_json(), "key": key}).encode()
    for _ in range(_CLAIM_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            claimed = _create_locked(directory, path, record)
            if claimed is not None:
                return claimed
            continue  # another record appeared (or a sweep took our temporary file): look again
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            time.sleep(0.02)  # a live owner, or a sweep holding it for a moment
            continue
        try:
            linked = os.lstat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            linked = False
        if not linked:  # a sweep removed it between our open and our lock: start again
            os.close(fd)
            continue
        # A dead owner's record, now ours.
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        return OwnerRecord(path, fd)
    raise ValueError(f"{path} belongs to a live process ({_read_record(path)}): another trainer "
                     "already uses this device (one trainer per device)")


def _create_locked(directory: Path, path: Path, record: bytes) -> OwnerRecord | None:
    """A new record at ``path``, locked before it gets there; None if ``path`` exists by now."""
    temporary = directory / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else opened it
        os.pwrite(fd, record, 0)
        os.link(temporary, path)
    except FileExistsError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return OwnerRecord(path, fd)


def sweep_stale_files(directory: Path) -> list[Path]:
    """Remove the files of owners that are gone from ``directory``; the paths removed."""
    keys: dict[str, set[str]] = {}
    for entry in os.scandir(directory):
        match = _OWNED.match(entry.name)
        if match:
            keys.setdefault(match["key"], set()).add(match["kind"])
    removed: list[Path] = []
    for key, kinds in sorted(keys.items()):
        if "owner" in kinds:
            removed += _sweep_owned(directory, key)
        else:
            removed += _sweep_unowned(directory, key, kinds)
    if removed:
        logger.warning("removed %d IPC files of dead jobs from %s: %s", len(removed), directory,
                       ", ".join(p.name for p in removed))
    return removed


def _sweep_owned(directory: Path, key: str) -> list[Path]:
    path = directory / f"{key}.owner"
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return []  # its owner just released it
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return []  # the owner lives
        try:
            if os.lstat(path).st_ino != os.fstat(fd).st_ino:
                return []  # replaced by a new owner since we opened it
        except FileNotFoundError:
            return []
        removed = _remove_files_of(directory, key)
        path.unlink()
        return [*removed, path]
    finally:
        os.close(fd)


def _sweep_unowned(directory: Path, key: str, kinds: set[str]) -> list[Path]:
    if (directory / f"{key}.owner").exists():
        return []  # claimed since we listed the directory
    sock = directory / f"{key}.sock"
    if "sock" in kinds and _listening(sock):
        return []
    return _remove_files_of(directory, key)


def _remove_files_of(directory: Path, key: str) -> list[Path]:
    """Remove ``key``'s socket and slots (not its owner record)."""
    removed = []
    for entry in os.scandir(directory):
        match = _OWNED.match(entry.name)
        if match and match["key"] == key and match["kind"] != "owner":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _listening(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _read_record(path: Path) -> str:
    try:
        return path.read_text()[:200] or "no record yet"
    except OSError as error:
        return f"record unreadable: {error}"
