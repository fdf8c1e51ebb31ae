"""Messages of the colocated-Python runtime: a header and buffers, the large ones
through a file of the host's shared-memory area."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from mtc import transfer


def _buffers(*sizes: int) -> list[np.ndarray]:
    return [np.arange(n, dtype=np.uint32).view(np.uint8)[:n] for n in sizes]


def test_small_buffers_travel_in_the_message(tmp_path: Path) -> None:
    bufs = _buffers(10, 0, 5000)
    msg = transfer.pack_message(tmp_path, {"op": "x"}, bufs)
    assert list(tmp_path.iterdir()) == []
    header, got = transfer.unpack_message(tmp_path, msg)
    assert header["op"] == "x" and "file" not in header
    for a, b in zip(bufs, got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_large_buffers_cross_in_a_file_the_receiver_unlinks(tmp_path: Path) -> None:
    bufs = _buffers(transfer.INLINE_LIMIT, 7)
    msg = transfer.pack_message(tmp_path, {}, bufs)
    assert len(msg) < 1024 and len(list(tmp_path.iterdir())) == 1
    header, got = transfer.unpack_message(tmp_path, msg)
    assert header["file"].startswith("call-") and list(tmp_path.iterdir()) == []
    for a, b in zip(bufs, got, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not got[0].flags.writeable


def _forged(header: dict[str, object], payload: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + payload


@pytest.mark.parametrize("message", [
    b"",
    _forged({"size": 4, "offsets": [0], "nbytes": [8]}, b"abcd"),  # beyond the payload
    _forged({"size": 0, "offsets": [], "nbytes": [], "file": "../../etc/passwd"}),
    _forged({"size": 0, "offsets": [0], "nbytes": []}),
])
def test_malformed_messages_are_refused(tmp_path: Path, message: bytes) -> None:
    with pytest.raises((ValueError, KeyError, TypeError)):
        transfer.unpack_message(tmp_path, message)
