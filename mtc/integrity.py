"""Checksums. CRC32C: hardware-accelerated here, and the checksum GCS keeps."""

from __future__ import annotations

from typing import Any

import google_crc32c


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of a bytes-like object (numpy arrays and mmaps included)."""
    if value:
        return int(google_crc32c.extend(value, data))
    return int(google_crc32c.value(data))
