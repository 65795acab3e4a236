"""How the colocated transport's buffers and socket reach the engine process.

- The socket and, on CPU, the shared-memory files live in a private directory
  ``<parent>/mcore_refit-<uid>`` (mode 0700, owned by this user; checked on both sides), so
  other users cannot connect or read weights.
- The address is unique to the physical device: the GPU's UUID (one trainer per GPU), or on CPU a
  caller-chosen id.
- GPU buffers travel as CUDA IPC handles (``torch.multiprocessing.reductions.reduce_tensor``),
  serialised field by field into the wire message: raw handle bytes plus integers, never pickle.
- CPU buffers are files in the private directory mapped ``MAP_SHARED`` on both sides.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from mcore_refit.refit.wire import SlotHandle

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
