"""Checksums. CRC32C: hardware-accelerated here, and the checksum GCS keeps."""

from __future__ import annotations

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

