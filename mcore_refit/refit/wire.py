"""The colocated transport's wire format: a fixed binary prefix, a JSON header, raw blobs.

One message is one ZMQ multipart message:

- frame 0: ``!4sHHI`` prefix (magic ``b"MCRF"``, format version, reserved 0, header length)
  followed by exactly that many bytes of UTF-8 JSON: ``{"kind": str, "fields": {...},
  "blob_sizes": [int, ...]}``;
- frames 1..n: raw byte blobs (IPC handles), one per ``blob_sizes`` entry, sizes checked.

Nothing is ever unpickled: a process that reaches the socket can at worst send a message that
fails validation. Decoding raises :class:`WireError` (a ``ValueError``) on anything unexpected.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

WIRE_MAGIC = b"MCRF"
WIRE_VERSION = 1
MAX_HEADER_BYTES = 64 << 20
MAX_BLOBS = 64
_PREFIX = struct.Struct("!4sHHI")

KINDS = frozenset({
    "hello", "ready", "start", "started", "buffer", "ack", "complete", "summary", "error",
})


class WireError(ValueError):
    """A message that is not a valid refit message of this version."""


@dataclass(frozen=True)
class Message:
    """A decoded message: its kind, JSON fields and raw blobs."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)
    blobs: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise WireError(f"unknown message kind {self.kind!r}")

    def get(self, key: str, kind: type | tuple[type, ...]) -> Any:
        """Field ``key``, which must be of type ``kind`` (bool is never an int here)."""
        if key not in self.fields:
            raise WireError(f"{self.kind} message lacks field {key!r}")
        value = self.fields[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise WireError(f"{self.kind} message field {key!r} has type "
                            f"{type(value).__name__}, expected {kind}")
        return value


def encode(message: Message) -> list[bytes]:
    """Frames for ``message`` (send with ``socket.send_multipart(frames, copy=False)``)."""
    header = json.dumps({"kind": message.kind, "fields": message.fields,
                         "blob_sizes": [len(b) for b in message.blobs]},
                        separators=(",", ":"), allow_nan=False).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise WireError(f"message header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    if len(message.blobs) > MAX_BLOBS:
        raise WireError(f"{len(message.blobs)} blobs exceed the limit of {MAX_BLOBS}")
    prefix = _PREFIX.pack(WIRE_MAGIC, WIRE_VERSION, 0, len(header))
    return [prefix + header, *(bytes(b) for b in message.blobs)]


def decode(frames: Sequence[bytes | memoryview]) -> Message:
    """Parse and validate the frames of one message."""
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
    blobs = tuple(bytes(f) for f in frames[1:])
    if len(sizes) != len(blobs) or any(
            isinstance(s, bool) or not isinstance(s, int) or s != len(b)
            for s, b in zip(sizes, blobs, strict=True)):
        raise WireError(f"blob sizes {sizes} do not match the {len(blobs)} frames received")
    return Message(kind=kind, fields=fields, blobs=blobs)
