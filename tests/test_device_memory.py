"""The trainer's CPU devices' memory (mtc.trainer.device_memory): reused as an
accelerator's pool reuses it, unless asked for glibc's default."""

from __future__ import annotations

import ctypes

import pytest

from mtc.trainer import device_memory


def test_glibc_takes_the_pool_settings() -> None:
    # mallopt answers 1 only for values it accepts: a threshold above glibc's
    # bound for this word size would come back 0 and leave the default.
    assert device_memory.pool() is True
    assert device_memory.configure("pooled") == "pooled"


def test_fresh_leaves_the_allocator_and_a_bad_mode_is_refused() -> None:
    assert device_memory.configure("fresh") == "fresh"
    with pytest.raises(ValueError, match="one of"):
        device_memory.configure("huge")


def test_a_c_library_without_mallopt_is_said_so(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoMallopt:
        def __init__(self, name: object) -> None:
            pass

    monkeypatch.setattr(ctypes, "CDLL", NoMallopt)
    assert device_memory.pool() is False
    assert device_memory.configure("pooled") == "fresh (no glibc)"
