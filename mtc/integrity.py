"""Checksums. CRC32C: hardware-accelerated here, and the checksum GCS keeps.

A large buffer's CRC32C is taken with the GIL released. google_crc32c's own
extension releases it only for ``bytes`` (immutable), and every buffer mtc
checksums is something else (a mapping of a file, a numpy view of a received
chunk, a reused buffer): holding the GIL there for the whole of a shard file
stopped every other thread of the process, so a replicator's streams and a
sidecar's readers and writers verified one at a time whatever the cores. The
same C function of the same library, called through ``ctypes`` (which releases
the GIL for the call), lets them run side by side. The buffer stays referenced
(exported, so neither resized nor unmapped) for the whole call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import google_crc32c
import numpy as np

# Below this a buffer's CRC32C costs less than handing the GIL over and back (a
# thread that gave it away may wait a switch interval to take it back): the
# threshold google_crc32c's extension uses for bytes.
NOGIL_MIN = 1 << 20


def _c_extend() -> Callable[[int, int, int], int] | None:
    """google_crc32c's ``crc32c_extend(crc, data, length)`` from the library its
    extension is linked with, checked against the extension once; None where this
    build does not expose it (the extension then serves, GIL held)."""
    try:
        from google_crc32c import _crc32c

        fn = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
    probe = np.frombuffer(b"123456789" * 7, np.uint8)
    if fn(17, probe.ctypes.data, probe.nbytes) != google_crc32c.extend(17, probe):
        return None
    return fn


_EXTEND = _c_extend()


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of a bytes-like object (numpy arrays, mmaps, memoryviews and bytearrays
    included), continuing ``value``; the GIL released for a large one."""
    if not isinstance(data, np.ndarray):
        # google_crc32c refuses memoryviews, bytearrays and mmaps ("must be
        # read-only bytes-like object"); a numpy view of the same memory is taken
        # by either path, without a copy.
        data = np.frombuffer(data, np.uint8)
    if _EXTEND is not None and data.nbytes >= NOGIL_MIN and data.flags.c_contiguous:
        return int(_EXTEND(value, data.ctypes.data, data.nbytes))
    if value:
        return int(google_crc32c.extend(value, data))
    return int(google_crc32c.value(data))
