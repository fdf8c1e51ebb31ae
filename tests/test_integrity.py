"""mtc.integrity.crc32c: the same checksum as google_crc32c's for every kind of
buffer mtc hands it, and a large one taken with the GIL released."""

from __future__ import annotations

import mmap
import sys
import threading
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtc import integrity
from mtc.integrity import NOGIL_MIN, crc32c

SIZES = [0, 1, 9, NOGIL_MIN - 1, NOGIL_MIN, NOGIL_MIN + 7, 3 * NOGIL_MIN + 1]


@pytest.mark.parametrize("n", SIZES)
def test_every_kind_of_buffer_gets_google_crc32c_s_checksum(n: int, tmp_path: Path) -> None:
    raw = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = google_crc32c.value(raw)
    assert crc32c(raw) == want
    assert crc32c(bytearray(raw)) == want
    assert crc32c(memoryview(raw)) == want
    assert crc32c(np.frombuffer(raw, np.uint8)) == want
    if n % 4 == 0 and n:
        assert crc32c(np.frombuffer(raw, np.float32)) == want  # any dtype: its bytes
    if n:
        path = tmp_path / "f"
        path.write_bytes(raw)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ) as m:
            assert crc32c(m) == want
    # Continued from a value, split anywhere: as one pass.
    cut = n // 3
    assert crc32c(raw[cut:], crc32c(raw[:cut])) == want
    assert crc32c(memoryview(raw)[cut:], crc32c(memoryview(raw)[:cut])) == want


@given(st.binary(max_size=4096), st.integers(0, 2**32 - 1))
def test_continuing_any_value_matches_the_extension(data: bytes, value: int) -> None:
    padded = data * (NOGIL_MIN // max(len(data), 1) + 1) if data else data
    for buf in (data, padded):
        assert crc32c(np.frombuffer(buf, np.uint8), value) == (
            google_crc32c.extend(value, buf) if value else google_crc32c.value(buf))


def test_a_strided_view_is_refused_as_by_the_extension() -> None:
    a = np.arange(2 * NOGIL_MIN, dtype=np.uint8)[::2]  # not contiguous: no raw pointer
    with pytest.raises((ValueError, TypeError, BufferError)):
        google_crc32c.value(a)
    with pytest.raises((ValueError, TypeError, BufferError)):
        crc32c(a)


def _woken_during_checksum(buf: np.ndarray) -> bool:
    """Whether a thread woken just as ``crc32c(buf)`` starts ran before it ended."""
    inside = [False]
    seen: list[bool] = []
    ready, go = threading.Event(), threading.Event()

    def woken() -> None:
        ready.set()
        go.wait()
        seen.append(inside[0])

    t = threading.Thread(target=woken)
    t.start()
    ready.wait()
    go.set()
    inside[0] = True
    crc32c(buf)
    inside[0] = False
    t.join()
    return seen[0]


def test_a_large_buffer_is_checksummed_with_the_gil_released() -> None:
    """The switch interval is raised so that, were the GIL held through the call,
    the woken thread could only run once the checksum is over."""
    assert integrity._EXTEND is not None, "this build of google_crc32c exposes crc32c_extend"
    buf = np.full(128 << 20, 7, np.uint8)
    saved = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        # Bounded: a loaded machine may wake the thread only after the checksum.
        ran = any(_woken_during_checksum(buf) for _ in range(10))
    finally:
        sys.setswitchinterval(saved)
    assert ran
