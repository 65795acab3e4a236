"""The files of IPC sharing: the private directory, its socket and shared slots, and who owns them.

- The socket and, on CPU, the shared-memory files live in a private directory
  ``<parent>/mcore_refit-<uid>`` (mode 0700, owned by this user; checked on both sides), so
  other users cannot connect or read weights.
- The address is unique to the physical device: the GPU's UUID (one trainer per GPU), or on CPU a
  caller-chosen id.
- GPU buffers travel as CUDA IPC handles (``torch.multiprocessing.reductions.reduce_tensor``),
  serialised field by field into a :class:`~.wire.SlotHandle`: raw handle bytes plus integers,
  never pickle. CPU buffers are files in the private directory mapped ``MAP_SHARED`` on both
  sides.
- Ownership: a trainer end that creates files there — its socket ``<key>.sock`` and, on CPU, its
  slots ``<key>.slot<N>`` — first claims ``<key>.owner`` (:func:`claim_owner`): a file holding its
  process identity (JSON, for people), locked with ``flock`` for as long as the process lives.
  The kernel drops the lock when the process ends, however it ends (SIGKILL included), so a lock
  that can be taken means the owner is gone, and a reused pid never keeps a dead job's files
  alive. :func:`sweep_stale_files` runs at every trainer start-up and removes the files of owners
  that are gone. It never touches a live owner's files: only the owner's lock decides. Files
  without an owner record (left by versions that wrote none) are removed only when nothing can
  hold them: a socket nobody listens on, and slots whose key has neither an owner record nor a
  listening socket (such a trainer bound its socket before creating its slots and removed it
  last). Other names in the directory (``.weights<N>`` files shared in place, anything else) are
  left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from mcore_refit.processes import ProcessIdentity
from mcore_refit.refit.transports.wire import SlotHandle

logger = logging.getLogger(__name__)

_KEY_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,79}$")
# Slots (``<key>.slot<N>``) and, for tensors shared in place, ``<name>.weights<N>``.
_SLOT_FILE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,79}\.(slot|weights)[0-9]{1,5}$")


def private_runtime_dir(parent: str | None) -> Path:
    """``<parent>/mcore_refit-<uid>``, created with mode 0700 and checked to be private.

    ``parent=None`` means ``/dev/shm`` when it exists (tmpfs: shared-memory files stay in RAM),
    else the system temp directory.
    """
    if parent is None:
        parent = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = Path(parent) / f"mcore_refit-{os.getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    """Raise ``ValueError`` unless ``path`` is a real directory owned by us with mode 0700."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{path} must be a directory (not a symlink or file)")
    if info.st_uid != os.getuid():
        raise ValueError(f"{path} is owned by uid {info.st_uid}, not by this user ({os.getuid()})")
    if stat.S_IMODE(info.st_mode) != 0o700:
        raise ValueError(
            f"{path} has mode {stat.S_IMODE(info.st_mode):04o}; it must be 0700 so that other "
            "users cannot reach the refit socket"
        )


def device_key(device: torch.device, *, cpu_device_id: str | None) -> str:
    """A name unique to the physical device: the GPU UUID, or ``cpu_device_id`` on CPU."""
    if device.type == "cuda":
        if cpu_device_id is not None:
            raise ValueError("cpu_device_id is only for CPU devices; a GPU is named by its UUID")
        return gpu_uuid(device)
    if cpu_device_id is None:
        raise ValueError("a colocated refit on CPU needs cpu_device_id: a unique name shared by "
                         "the trainer and the engine process")
    if not _KEY_PATTERN.match(cpu_device_id):
        raise ValueError(f"cpu_device_id {cpu_device_id!r} must match {_KEY_PATTERN.pattern}")
    return cpu_device_id


def gpu_uuid(device: torch.device) -> str:
    return "GPU-" + str(torch.cuda.get_device_properties(device).uuid)


def socket_path(directory: Path, key: str) -> Path:
    path = directory / f"{key}.sock"
    if len(str(path)) > 100:
        raise ValueError(f"socket path {path} is too long for a Unix socket; use a shorter "
                         "refit.ipc_dir")
    return path


def address_of(path: Path) -> str:
    return f"ipc://{path}"


def path_of(address: str) -> Path:
    """The socket path of an ``ipc://`` address whose directory is private."""
    if not address.startswith("ipc://"):
        raise ValueError(f"colocated refit address must start with ipc://, got {address!r}")
    path = Path(address.removeprefix("ipc://"))
    check_private_dir(path.parent)
    return path


def claim_socket_path(path: Path) -> None:
    """Remove a stale socket at ``path``; refuse if a live process is listening there."""
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # left over from a process that died
        return
    finally:
        probe.close()
    raise ValueError(f"another trainer is already bound at {path} (one trainer per device)")


def create_shared_cpu_slot(path: Path, nbytes: int) -> torch.Tensor:
    """A zero-filled ``uint8`` tensor backed by a new 0600 file, mapped shared."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def describe_slot(slot: torch.Tensor, *, cpu_file: Path | None,
                  first_blob: int = 0) -> tuple[SlotHandle, list[bytes]]:
    """How another process maps ``slot``: a handle and its raw blobs (the CUDA IPC handle, its
    ref-counter and event handles; none for a shared-memory file). ``first_blob`` is where the
    blobs will sit among all blobs of the message."""
    if slot.device.type == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        rebuild, args = reduce_tensor(slot)
        assert rebuild is rebuild_cuda_tensor
        (_, size, stride, tensor_offset, _, dtype, _, handle, storage_size_bytes,
         storage_offset_bytes, _, ref_counter_handle, ref_counter_offset, event_handle,
         event_sync_required) = args
        assert tuple(size) == (slot.numel(),) and tuple(stride) == (1,) and dtype == torch.uint8
        blobs = [bytes(handle), bytes(ref_counter_handle), bytes(event_handle or b"")]
        return SlotHandle(
            kind="cuda", nbytes=slot.numel(), first_blob=first_blob, num_blobs=len(blobs),
            tensor_offset=tensor_offset, storage_size_bytes=storage_size_bytes,
            storage_offset_bytes=storage_offset_bytes, ref_counter_offset=ref_counter_offset,
            event_sync_required=bool(event_sync_required),
            has_event_handle=event_handle is not None), blobs
    assert cpu_file is not None
    return SlotHandle(kind="shm", nbytes=slot.numel(), file=cpu_file.name), []


def describe_storage(tensor: torch.Tensor, *, directory: Path,
                     first_blob: int = 0) -> tuple[SlotHandle, list[bytes]]:
    """How another process maps the whole storage under ``tensor`` (as :func:`describe_slot`
    does a slot). On CPU the storage must be a shared-memory file in ``directory``."""
    storage = tensor.untyped_storage()
    if tensor.device.type == "cuda":
        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
            storage, 0, (storage.nbytes(),), (1,))
        return describe_slot(flat, cpu_file=None, first_blob=first_blob)
    filename = getattr(storage, "filename", None)
    if filename is None or Path(filename).parent != directory:
        raise ValueError(f"a CPU tensor is shared with the engine only from a shared-memory "
                         f"file in {directory}; this one lives in "
                         f"{'private memory' if filename is None else filename}")
    return SlotHandle(kind="shm", nbytes=storage.nbytes(), file=Path(filename).name), []


def open_slot(handle: SlotHandle, blobs: Sequence[bytes], *, device: torch.device,
              directory: Path) -> torch.Tensor:
    """Map a slot described by :func:`describe_slot` into this process (``blobs`` are all the
    message's blobs)."""
    if handle.nbytes < 0:
        raise ValueError(f"slot size must be non-negative, got {handle.nbytes}")
    if handle.kind == "shm":
        if device.type != "cpu":
            raise ValueError(f"the trainer shares CPU memory but this engine is on {device}")
        name = handle.file
        if not isinstance(name, str) or not _SLOT_FILE_PATTERN.match(name):
            raise ValueError(f"invalid shared-memory file name {name!r}")
        path = directory / name
        if os.lstat(path).st_uid != os.getuid():
            raise ValueError(f"{path} is not owned by this user")
        return torch.from_file(str(path), shared=True, size=handle.nbytes, dtype=torch.uint8)
    if device.type != "cuda":
        raise ValueError(f"the trainer shares GPU memory but this engine is on {device}")
    own = blobs[handle.first_blob:handle.first_blob + handle.num_blobs]
    if len(own) != 3:
        raise ValueError(f"a CUDA slot needs 3 handle blobs, got {len(own)}")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    ipc_handle, ref_counter_handle, event_handle = own
    return rebuild_cuda_tensor(
        torch.Tensor, (handle.nbytes,), (1,), handle.tensor_offset, torch.storage.TypedStorage,
        torch.uint8, device.index, ipc_handle, handle.storage_size_bytes,
        handle.storage_offset_bytes, False, ref_counter_handle, handle.ref_counter_offset,
        event_handle if handle.has_event_handle else None, handle.event_sync_required,
    )


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
