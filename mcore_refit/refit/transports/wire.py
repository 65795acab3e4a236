"""Typed messages of the IPC protocols: the colocated transport's requests and replies, and the
slot handles both transports hand over. One frozen dataclass per kind, validated once at decode.

One message is one ZMQ multipart message:

- frame 0: ``!4sHHI`` prefix (magic ``b"MCRF"``, format version, reserved 0, header length)
  followed by exactly that many bytes of UTF-8 JSON: ``{"kind": str, "fields": {...},
  "blob_sizes": [int, ...]}``;
- frames 1..n: raw byte blobs (IPC handles, digest tables), one per ``blob_sizes`` entry.

:func:`decode` checks the prefix, then builds the message class named by ``kind`` from its fields,
checking every field against the class's annotations (a ``bool`` is never an ``int``); protocol
code receives typed messages and never looks fields up by name. Nothing is ever unpickled: a
process that reaches the socket can at worst send a message that fails validation.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

WIRE_MAGIC = b"MCRF"
WIRE_VERSION = 4
MAX_HEADER_BYTES = 64 << 20
# Sharing a model's weights takes 3 blobs per storage (one storage per tensor at worst).
MAX_BLOBS = 1 << 16
_PREFIX = struct.Struct("!4sHHI")


class WireError(ValueError):
    """A message that is not a valid refit message of this version."""


@dataclass(frozen=True, kw_only=True)
class SlotHandle:
    """How to map one of the trainer's slots: a CUDA IPC handle (its bytes are blobs
    ``first_blob .. first_blob + num_blobs`` of the hello) or a shared-memory file."""

    kind: typing.Literal["cuda", "shm"]
    nbytes: int
    first_blob: int = 0
    num_blobs: int = 0
    file: str | None = None
    tensor_offset: int = 0
    storage_size_bytes: int = 0
    storage_offset_bytes: int = 0
    ref_counter_offset: int = 0
    event_sync_required: bool = False
    has_event_handle: bool = False


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of every message; ``KIND`` names it on the wire."""

    KIND: ClassVar[str] = ""


@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """Trainer → engine, once per connection: the plan and the slots to map."""

    KIND: ClassVar[str] = "hello"
    plan: str
    device_key: str
    slots: tuple[SlotHandle, ...]
    blobs: tuple[bytes, ...] = ()
    # No slots: the trainer shares the memory of its own tensors (:class:`ShareWeights`).
    shares_weights: bool = False


@dataclass(frozen=True, kw_only=True)
class Ready(Message):
    KIND: ClassVar[str] = "ready"
    fingerprint: str


@dataclass(frozen=True, kw_only=True)
class Start(Message):
    """Trainer → engine: a refit starts (plan fingerprint and switches)."""

    KIND: ClassVar[str] = "start"
    refit_index: int
    fingerprint: str
    checksums: bool
    verify: bool


@dataclass(frozen=True, kw_only=True)
class Started(Message):
    KIND: ClassVar[str] = "started"
    refit_index: int
    # The key of the trainer tensors this engine has mapped (:class:`ShareWeights`), if any.
    shared_key: str | None = None


@dataclass(frozen=True, kw_only=True)
class SharedTensor:
    """Where one planned tensor lies in a shared storage: ``storage`` indexes the message's
    storages (-1: an empty tensor, nothing to map); ``offset``, ``shape`` and ``stride`` are in
    elements of the plan's dtype.

    A tensor whose elements lie apart in the trainer's memory (the query rows of each key-value
    group in a fused QKV weight) is a series of equal runs along ``dim``: run ``i`` is the view
    of ``shape`` and ``stride`` at ``run_offsets[i]``, filling ``[run_starts[i], run_starts[i] +
    shape[dim])`` of the planned tensor. Without runs, the view at ``offset`` is the whole
    tensor."""

    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dim: int = 0
    run_starts: tuple[int, ...] = ()
    run_offsets: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ShareWeights(Message):
    """Trainer → engine: map these storages of the trainer's memory and read every planned
    tensor (in plan order) from them from now on; ``key`` names this layout."""

    KIND: ClassVar[str] = "share_weights"
    key: str
    storages: tuple[SlotHandle, ...]
    tensors: tuple[SharedTensor, ...]
    blobs: tuple[bytes, ...] = ()


@dataclass(frozen=True, kw_only=True)
class WeightsReady(Message):
    """Trainer → engine: the shared tensors hold this refit's weights; load all of them."""

    KIND: ClassVar[str] = "weights_ready"
    refit_index: int


@dataclass(frozen=True, kw_only=True)
class BufferReady(Message):
    """Trainer → engine: buffer ``buffer_index`` is packed in its slot (names and sizes are the
    plan's; the in-slot header repeats the indices and carries the checksum)."""

    KIND: ClassVar[str] = "buffer"
    refit_index: int
    buffer_index: int


@dataclass(frozen=True, kw_only=True)
class Ack(Message):
    """Engine → trainer: the buffer is loaded (the slot may be refilled), or why not."""

    KIND: ClassVar[str] = "ack"
    buffer_index: int
    ok: bool
    message: str | None = None


@dataclass(frozen=True, kw_only=True)
class Complete(Message):
    """Trainer → engine: the refit's last buffer was sent (or ``aborted`` says why not); with
    verification, blob 0 is the trainer's ``[num_tensors, DIGEST_WORDS]`` int64 digest table."""

    KIND: ClassVar[str] = "complete"
    refit_index: int
    aborted: str | None = None
    blobs: tuple[bytes, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Summary(Message):
    """Engine → trainer: every planned tensor loaded exactly once (and equal), or why not."""

    KIND: ClassVar[str] = "summary"
    ok: bool
    message: str | None = None
    num_tensors: int = 0
    payload_bytes: int = 0
    verified: bool = False


@dataclass(frozen=True, kw_only=True)
class Error(Message):
    """Either side: a request was malformed, out of order or refused."""

    KIND: ClassVar[str] = "error"
    message: str
    # The engine restarted since the trainer's hello: send it again.
    need_hello: bool = False


MESSAGES: dict[str, type[Message]] = {cls.KIND: cls for cls in (
    Hello, Ready, Start, Started, ShareWeights, WeightsReady, BufferReady, Ack, Complete, Summary,
    Error)}


def encode(message: Message) -> list[bytes]:
    """Frames for ``message`` (send with ``socket.send_multipart(frames, copy=False)``)."""
    fields = to_fields(message)
    blobs = tuple(getattr(message, "blobs", ()))
    header = json.dumps({"kind": message.KIND, "fields": fields,
                         "blob_sizes": [len(b) for b in blobs]},
                        separators=(",", ":"), allow_nan=False).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise WireError(f"message header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    if len(blobs) > MAX_BLOBS:
        raise WireError(f"{len(blobs)} blobs exceed the limit of {MAX_BLOBS}")
    prefix = _PREFIX.pack(WIRE_MAGIC, WIRE_VERSION, 0, len(header))
    return [prefix + header, *(bytes(b) for b in blobs)]


def decode(frames: Sequence[bytes | memoryview]) -> Message:
    """Parse and validate the frames of one message into its message class."""
    if not frames:
        raise WireError("empty message")
    first = bytes(frames[0])
    if len(first) < _PREFIX.size:
        raise WireError(f"message of {len(first)} bytes is shorter than the {_PREFIX.size}-byte "
                        "prefix")
    magic, version, reserved, header_len = _PREFIX.unpack_from(first)
    if magic != WIRE_MAGIC:
        raise WireError(f"bad magic {magic!r}: not a refit message")
    if version != WIRE_VERSION:
        raise WireError(f"wire format version {version}, this side speaks {WIRE_VERSION}; "
                        "trainer and engine run different mcore_refit versions")
    if reserved != 0 or header_len > MAX_HEADER_BYTES or len(first) != _PREFIX.size + header_len:
        raise WireError(f"inconsistent prefix: reserved={reserved}, header length {header_len}, "
                        f"frame length {len(first)}")
    try:
        header = json.loads(first[_PREFIX.size:].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireError(f"message header is not JSON: {error}") from None
    if not isinstance(header, dict) or set(header) != {"kind", "fields", "blob_sizes"}:
        raise WireError("message header must have exactly kind, fields and blob_sizes")
    kind, fields, sizes = header["kind"], header["fields"], header["blob_sizes"]
    if not isinstance(kind, str) or not isinstance(fields, dict) or not isinstance(sizes, list):
        raise WireError("message header fields have the wrong types")
    cls = MESSAGES.get(kind)
    if cls is None:
        raise WireError(f"unknown message kind {kind!r}")
    blobs = tuple(bytes(f) for f in frames[1:])
    if len(sizes) != len(blobs) or any(
            isinstance(s, bool) or not isinstance(s, int) or s != len(b)
            for s, b in zip(sizes, blobs, strict=True)):
        raise WireError(f"blob sizes {sizes} do not match the {len(blobs)} frames received")
    if blobs and "blobs" not in {f.name for f in dataclasses.fields(cls)}:
        raise WireError(f"a {kind} message carries no blobs, got {len(blobs)}")
    message = _build(cls, fields, where=kind)
    return dataclasses.replace(message, blobs=blobs) if blobs else message


def to_fields(message: Any) -> dict[str, Any]:
    """A message (or :class:`SlotHandle`) as plain JSON data, without its blobs."""
    return {f.name: _plain(getattr(message, f.name)) for f in dataclasses.fields(message)
            if f.name != "blobs"}


def from_fields(cls: type, data: Any, *, where: str | None = None):
    """Build ``cls`` (a message or :class:`SlotHandle`) from plain data, validated as
    :func:`decode` does; :class:`WireError` on anything unexpected."""
    where = where or getattr(cls, "KIND", "") or cls.__name__
    if not isinstance(data, dict):
        raise WireError(f"{where} must be an object, got {type(data).__name__}")
    return _build(cls, data, where=where)


def _build(cls: type, fields: dict[str, Any], *, where: str):
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.name != "blobs"}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise WireError(f"{where} message has unknown field {unknown[0]!r}")
    values = {}
    for name, field in known.items():
        if name in fields:
            values[name] = _check(hints[name], fields[name], f"{where}.{name}")
        elif field.default is dataclasses.MISSING:
            raise WireError(f"{where} message lacks field {name!r}")
    return cls(**values)


def _check(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [option for option in options if option is not type(None)]
        return _check(inner, value, where)
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise WireError(f"field {where!r} must be one of {typing.get_args(hint)}, "
                            f"got {value!r}")
        return value
    if origin is tuple:
        (item,) = typing.get_args(hint)[:1]
        if not isinstance(value, list):
            raise WireError(f"field {where!r} must be a list, got {type(value).__name__}")
        return tuple(_check(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise WireError(f"field {where!r} must be an object, got {type(value).__name__}")
        return _build(hint, value, where=where)
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise WireError(f"field {where!r} has type {type(value).__name__}, expected int")
    if hint in (bool, str) and not isinstance(value, hint):
        raise WireError(f"field {where!r} has type {type(value).__name__}, expected "
                        f"{hint.__name__}")
    return value


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
