"""The XLA flags of every JAX process the tests run (this one, and the ones they start).

``FAST_COMPILE``: XLA's CPU backend without LLVM's optimisations. The tests check
what programs compute, never how fast the generated code runs, and on this
project's 2-core machines LLVM's passes were most of a test process's CPU: the
tiny model's training step took 7 s to compile, 2 s without them (the fast lane
about a third less CPU in all). What a program computes is the same either way
(XLA's own HLO passes still run; a test that compares two runs compares two runs
compiled alike). Processes the tests start inherit it through ``XLA_FLAGS``
(tests/conftest.py sets it before JAX starts); a harness that writes its
children's ``XLA_FLAGS`` anew builds them with :func:`cpu_flags`.
"""

from __future__ import annotations

FAST_COMPILE = "--xla_backend_optimization_level=0"


def with_fast_compile(flags: str) -> str:
    """``flags`` with :data:`FAST_COMPILE`, unless they set the level themselves."""
    if "--xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} {FAST_COMPILE}".strip()


def without_fast_compile(flags: str) -> str:
    """``flags`` less :data:`FAST_COMPILE`: for a child that runs its programs many
    times (a benchmark, a trainer's hundred steps), where LLVM's passes pay."""
    return " ".join(f for f in flags.split() if f != FAST_COMPILE)


def cpu_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a child JAX process with ``devices`` CPU devices."""
    return with_fast_compile(f"--xla_force_host_platform_device_count={devices}")
