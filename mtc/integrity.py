"""Checksums. CRC32C: hardware-accelerated here, and the checksum GCS keeps."""

from __future__ import annotations

import os
import stat
from typing import Any

import google_crc32c
import numpy as np


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of a bytes-like object (numpy arrays, mmaps, memoryviews and bytearrays included)."""
    if isinstance(data, memoryview | bytearray):
        # google_crc32c takes bytes, numpy arrays and mmaps, but refuses memoryviews
        # and bytearrays ("must be read-only bytes-like object"); a numpy view of the
        # same memory is accepted, without a copy.
        data = np.frombuffer(data, np.uint8)
    if value:
        return int(google_crc32c.extend(value, data))
    return int(google_crc32c.value(data))


def read_buffer(f: Any, chunk: int) -> memoryview:
    """A buffer to read an open file through, to checksum or copy it: ``chunk``
    bytes, but no more than a regular file holds. A new bytearray is zero-filled,
    and a step is hundreds of small shard files: a chunk-sized buffer for each
    was most of a replicator's CPU after a save (0.7 GB filled for a 19 MB step,
    on the cores the trainer uses). A stream of unknown length (a pipe, a socket,
    no file at all) gets the whole chunk."""
    try:
        st = os.fstat(f.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is a ValueError
        return memoryview(bytearray(chunk))
    size = st.st_size if stat.S_ISREG(st.st_mode) else chunk
    return memoryview(bytearray(max(1, min(chunk, size))))
