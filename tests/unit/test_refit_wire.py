"""The colocated wire format: encode/decode, version and garbage rejection, private directory."""

import json
import os
import re
import struct

import pytest

from mcore_refit.refit.transports.ipc_files import check_private_dir, private_runtime_dir
from mcore_refit.refit.transports.wire import (
    WIRE_VERSION,
    Ack,
    BufferReady,
    Complete,
    Error,
    Hello,
    Ready,
    SlotHandle,
    Start,
    Started,
    Summary,
    WireError,
    decode,
    encode,
)


def _hello() -> Hello:
    return Hello(plan="{}", device_key="GPU-1", blobs=(b"\x00\x01handle", b"", b"x" * 1000),
                 slots=(SlotHandle(kind="cuda", nbytes=4, first_blob=0, num_blobs=3),
                        SlotHandle(kind="shm", nbytes=8, file="a.slot1")))


@pytest.mark.parametrize("message", [
    _hello(), Ready(fingerprint="ab"), Start(refit_index=3, fingerprint="ab", checksums=True,
                                             verify=False),
    Started(refit_index=3), BufferReady(refit_index=3, buffer_index=7),
    Ack(buffer_index=7, ok=False, message="boom"), Ack(buffer_index=7, ok=True),
    Complete(refit_index=3, aborted=None, blobs=(b"digests",)),
    Summary(ok=True, num_tensors=2, payload_bytes=10, verified=True),
    Error(message="no", need_hello=True),
], ids=lambda m: m.KIND)
def test_every_message_round_trips_typed(message):
    frames = encode(message)
    assert frames[0][:4] == b"MCRF"
    decoded = decode(frames)
    assert type(decoded) is type(message) and decoded == message
    assert decode([memoryview(f) for f in frames]) == message


def _frame(header: dict | bytes, *, magic=b"MCRF", version=WIRE_VERSION, reserved=0,
           length_delta=0) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("!4sHHI", magic, version, reserved, len(body) + length_delta) + body


GOOD = {"kind": "ack", "fields": {"buffer_index": 0, "ok": True}, "blob_sizes": []}


@pytest.mark.parametrize("frames, message", [
    ([], "empty message"),
    ([b"MCRF"], "message of 4 bytes is shorter than the 12-byte prefix"),
    ([_frame(GOOD, magic=b"\x80\x04\x95\x00")], "bad magic"),  # a pickle stream's first bytes
    ([_frame(GOOD, version=WIRE_VERSION + 1)],
     f"wire format version {WIRE_VERSION + 1}, this side speaks {WIRE_VERSION}"),
    ([_frame(GOOD, reserved=1)], "inconsistent prefix"),
    ([_frame(GOOD, length_delta=3)], "inconsistent prefix"),
    ([_frame(b"\xff\xfe not utf8")], "message header is not JSON"),
    ([_frame(b"[1, 2]")], "message header must have exactly kind, fields and blob_sizes"),
    ([_frame({**GOOD, "extra": 1})],
     "message header must have exactly kind, fields and blob_sizes"),
    ([_frame({**GOOD, "fields": []})], "message header fields have the wrong types"),
    ([_frame({**GOOD, "kind": "exec"})], "unknown message kind 'exec'"),
    ([_frame({**GOOD, "blob_sizes": [3]})], r"blob sizes \[3\] do not match the 0 frames"),
    ([_frame({**GOOD, "blob_sizes": [3]}), b"abcd"], r"blob sizes \[3\] do not match the 1"),
    ([_frame({**GOOD, "blob_sizes": [True]}), b"a"], "blob sizes"),
])
def test_garbage_is_rejected(frames, message):
    with pytest.raises(WireError, match=message):
        decode(frames)


@pytest.mark.parametrize("kind, fields, message", [
    ("ack", {"ok": True}, "ack message lacks field 'buffer_index'"),
    ("ack", {"buffer_index": True, "ok": True},
     "field 'ack.buffer_index' has type bool, expected int"),
    ("ack", {"buffer_index": 1, "ok": 1}, "field 'ack.ok' has type int, expected bool"),
    ("ack", {"buffer_index": 1, "ok": True, "names": []}, "ack message has unknown field 'names'"),
    ("hello", {"plan": "{}", "device_key": "k", "slots": [{"kind": "tcp", "nbytes": 1}]},
     "field 'hello.slots[0].kind' must be one of"),
    ("hello", {"plan": "{}", "device_key": "k", "slots": {}},
     "field 'hello.slots' must be a list, got dict"),
    ("summary", {"ok": True, "message": 3}, "field 'summary.message' has type int, expected str"),
])
def test_fields_are_validated_once_at_decode(kind, fields, message):
    frames = [_frame({"kind": kind, "fields": fields, "blob_sizes": []})]
    with pytest.raises(WireError, match=re.escape(message)):
        decode(frames)


def test_blobs_only_where_a_message_carries_them():
    with pytest.raises(WireError, match="a ack message carries no blobs, got 1"):
        decode([_frame({**GOOD, "blob_sizes": [1]}), b"a"])


def test_private_dir_is_created_0700_and_checked(tmp_path):
    path = private_runtime_dir(str(tmp_path))
    assert path.name == f"mcore_refit-{os.getuid()}"
    assert os.stat(path).st_mode & 0o777 == 0o700
    assert private_runtime_dir(str(tmp_path)) == path  # idempotent
    os.chmod(path, 0o755)
    with pytest.raises(ValueError, match="has mode 0755; it must be 0700"):
        private_runtime_dir(str(tmp_path))
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="must be a directory"):
        check_private_dir(link)
