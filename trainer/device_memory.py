"""How the trainer's CPU devices' memory behaves: as an accelerator's pool, by default.

The demo's trainer runs on CPU devices that stand in for accelerators. An
accelerator's runtime takes device buffers from a pool it keeps (a step's
outputs land in memory the previous steps freed); XLA's CPU client takes them
from glibc's malloc, which by default maps large blocks fresh from the kernel
and unmaps them when freed, so every step's new buffers (the per-step
snapshot's copy above all: a state-sized buffer a step, never donated) are
first-touch page faults, paid on the devices' threads: a cost in every step,
coming in runs of slow steps (docs/elastic-demo.md), that no accelerator pays
for device memory.
:func:`pool` has glibc keep freed blocks up to its largest mmap threshold
(32 MiB on 64-bit) for reuse, as a device pool would. ``fresh``: glibc's
default, kept for comparison (``--device-memory fresh``).

What it cannot stand for: on a TPU the snapshot copy lands in pinned host
memory, whose first use costs the host as fresh pages do here (docs/hosts.md
measures it); the CPU client cannot put a compiled step's output there.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

MODES = ("pooled", "fresh")
DEFAULT = "pooled"  # the trainer's and the goodput bench's
# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's upper bound for M_MMAP_THRESHOLD on 64-bit (4 MiB x sizeof(long)).
POOLED_BLOCK_BYTES = 32 << 20
# Free memory at the top of the heap kept rather than given back to the kernel.
KEPT_FREE_BYTES = 1 << 30


def pool() -> bool:
    """Have this process's malloc keep freed blocks of up to 32 MiB for reuse and
    not give free heap back to the kernel below 1 GiB. Returns whether it took
    (False off glibc: the allocator is then left as it is, and the trainer says so)."""
    try:
        # The symbols this process already has: the C library Python runs on.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return (mallopt(_M_MMAP_THRESHOLD, POOLED_BLOCK_BYTES) == 1
            and mallopt(_M_TRIM_THRESHOLD, KEPT_FREE_BYTES) == 1)


def configure(mode: str) -> str:
    """Set the devices' memory up as ``mode`` asks; returns what it is: ``pooled``,
    ``fresh``, or ``fresh (no glibc)`` where pooling was asked and cannot be had."""
    if mode not in MODES:
        raise ValueError(f"device memory {mode!r}: one of {MODES}")
    if mode == "fresh":
        return "fresh"
    if pool():
        return "pooled"
    log.warning("device memory: this C library has no mallopt; buffers come fresh")
    return "fresh (no glibc)"
