"""Files a run reads and writes: integrity checks before use, and I/O errors that name the path.

- :func:`check_safetensors` and :func:`check_distributed_checkpoint` read only headers and
  indexes (no tensor data) and raise :class:`CorruptFile` naming the first file that is
  missing, unreadable or shorter than its own index says: a truncated download or copy, a
  process killed while writing, a full disk;
- :func:`writing` turns an ``OSError`` raised while writing into one that names the path and the
  cause (``no space left on device writing PATH``); :func:`disk_full` tells a full device
  behind errors that hide their errno (torch's zip writer: ``unexpected pos 704 vs 598``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

# Below this many free bytes a failed write is put down to a full device.
DISK_FULL_BYTES = 1 << 20


class CorruptFile(ValueError):
    """A file is missing, unreadable or truncated; the message names it and what is wrong."""


def check_safetensors(path: str | Path) -> None:
    """Check that ``path`` is a whole safetensors file: its header parses and every tensor's
    bytes lie within the file."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise CorruptFile(f"{path} is not a safetensors file ({size} bytes, shorter than the "
                              "8-byte header length)")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if 8 + header_bytes > size:
            raise CorruptFile(f"{path} is truncated: {size} bytes, its header alone needs "
                              f"{8 + header_bytes}")
        try:
            header = json.loads(file.read(header_bytes))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CorruptFile(f"{path} has an unreadable safetensors header ({error})") from None
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    needed = 8 + header_bytes + max(ends, default=0)
    if needed > size:
        raise CorruptFile(f"{path} is truncated: {size} bytes, its header needs {needed} (a "
                          "download or copy cut short?)")


def check_checkpoint_directory(path: str | Path) -> None:
    """:func:`check_safetensors` on every ``*.safetensors`` file of a Hugging Face checkpoint."""
    for file in sorted(Path(path).glob("*.safetensors")):
        check_safetensors(file)


def check_distributed_checkpoint(path: str | Path) -> None:
    """Check a ``torch_dist`` checkpoint directory (Megatron's distributed checkpointing): its
    ``metadata.json``, its index (``.metadata``) and that every shard file it indexes holds
    the bytes the index places in it."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    content = path / "metadata.json"
    try:
        json.loads(content.read_text())
    except FileNotFoundError:
        raise CorruptFile(f"{content} is missing") from None
    except (OSError, ValueError) as error:
        raise CorruptFile(f"{content} is unreadable ({type(error).__name__}: {error})") from None
    index = path / ".metadata"
    if not index.is_file():
        raise CorruptFile(f"{index} is missing")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # an unpickling error of any kind: the file is cut or garbled
        raise CorruptFile(f"{index} is unreadable ({type(error).__name__}: {error})") from None
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        end = item.offset + item.length
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        shard = path / name
        try:
            size = shard.stat().st_size
        except FileNotFoundError:
            raise CorruptFile(f"{shard} is missing (the checkpoint's index names it)") from None
        if size < end:
            raise CorruptFile(f"{shard} is truncated: {size} bytes, the checkpoint's index "
                              f"needs {end}")


def disk_full(path: str | Path) -> bool:
    """Whether the device holding ``path`` (or its nearest existing parent) is full."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free < DISK_FULL_BYTES
    except OSError:
        return False


def no_space(path: str | Path) -> OSError:
    """The error of a write to ``path`` that found its device full."""
    return OSError(errno.ENOSPC, f"no space left on device writing {path}")


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Inside the block, an ``OSError`` (or an error hiding one: a full device) becomes an
    ``OSError`` that names ``path``: ``no space left on device writing PATH``, or
    ``<strerror> writing PATH``."""
    try:
        yield
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise no_space(path) from error
        if error.filename is not None:
            raise  # it names its file already
        reason = error.strerror or str(error)
        raise OSError(error.errno, f"{reason} writing {path}") from error
    except RuntimeError as error:
        if disk_full(path):
            raise no_space(path) from error
        raise


def replace_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half a file; an
    error names the path (and a full device as such)."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    with writing(path):
        try:
            with temporary.open("w") as file:
                file.write(text)
                file.flush()
                os.fsync(file.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        os.replace(temporary, path)
