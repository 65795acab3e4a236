"""The colocated wire format: encode/decode, version and garbage rejection, private directory."""

import json
import os
import struct

import pytest

from mcore_refit.refit.ipc_memory import check_private_dir, private_runtime_dir
from mcore_refit.refit.wire import WIRE_VERSION, Message, WireError, decode, encode


def test_round_trip_with_blobs():
    message = Message(kind="hello", fields={"plan": "{}", "slots": [{"nbytes": 4}], "n": None},
                      blobs=(b"\x00\x01handle", b"", b"x" * 1000))
    frames = encode(message)
    assert frames[0][:4] == b"MCRF" and len(frames) == 4
    assert decode(frames) == message
    assert decode([memoryview(f) for f in frames]) == message


def _frame(header: dict | bytes, *, magic=b"MCRF", version=WIRE_VERSION, reserved=0,
           length_delta=0) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("!4sHHI", magic, version, reserved, len(body) + length_delta) + body


GOOD = {"kind": "ack", "fields": {"ok": True}, "blob_sizes": []}


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


def test_typed_field_access():
    message = decode(encode(Message(kind="buffer", fields={"buffer_index": 3, "ok": True})))
    assert message.get("buffer_index", int) == 3
    with pytest.raises(WireError, match="field 'ok' has type bool"):
        message.get("ok", int)
    with pytest.raises(WireError, match="buffer message lacks field 'names'"):
        message.get("names", list)


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
