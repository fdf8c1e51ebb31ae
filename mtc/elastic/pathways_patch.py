"""pathwaysutils, patched where it cannot run here as it is, and put back afterwards.

:func:`patched` is a context manager that installs, and on exit restores:

- ``pathwaysutils.elastic.elastic.get_slice_to_devices``, when the devices carry
  no ``slice_index`` (CPU devices: tests, and this machine): a grouping given by
  the caller (``devices_per_slice`` consecutive devices, or ``slice_of``);
- ``DefaultSliceHealthChecker``: :class:`CachedSliceHealthChecker` (below).

Enter it before creating the ``Manager`` and leave it after the Manager is closed
(its monitor thread checks slices with the checker).

pathwaysutils' slice health check, with its executables kept between checks:

``pathwaysutils.elastic.elastic.DefaultSliceHealthChecker`` runs ``jax.pmap``
of a bound method of a checker it builds anew for every check, so no JAX cache
ever hits: each check traces and compiles one program per slice (a compile,
each time). The Manager's monitor thread checks the inactive slices every
poll interval, and every elastic attempt checks them all, so while training
runs on fewer slices the compiles take a steady share of the CPU, and they sit
on the way to every recovery. :class:`CachedSliceHealthChecker` runs the same
computation (``x + 1`` on every device of the slice, expected 100) with one
pmapped function per slice, built once, always run under no default device:
JAX then compiles it once and reuses the executable: a check costs a dispatch,
not a compile.

:func:`install` makes it the checker pathwaysutils builds when none is passed
(its Manager passes none), as the trainer already replaces
``get_slice_to_devices``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from pathwaysutils.elastic import elastic as pw_elastic

_lock = threading.Lock()  # the loop and the Manager's monitor thread build functions
_pmapped: dict[tuple[int, ...], Callable[[Any], jax.Array]] = {}


def _plus_one(x: jax.Array) -> jax.Array:
    return x + 1


def _for(devices: Sequence[jax.Device]) -> Callable[[Any], jax.Array]:
    """The pmapped check for these devices (one per device list for the process:
    a function JAX has seen keeps its compiled executables)."""
    key = tuple(d.id for d in devices)
    with _lock:
        fn = _pmapped.get(key)
        if fn is None:
            fn = _pmapped[key] = jax.pmap(_plus_one, devices=list(devices))
        return fn


class CachedSliceHealthChecker(pw_elastic.DefaultSliceHealthChecker):
    """``DefaultSliceHealthChecker`` whose per-slice programs are compiled once."""

    def _simple_execution(self, devices: Sequence[jax.Device]) -> jax.Array:
        if not devices:
            raise ValueError("No devices")
        test_input = np.zeros(len(devices), dtype=float) + (
            pw_elastic._SIMPLE_EXECUTION_TEST_VALUE - 1)
        # Under no default device whatever the caller's: the default device is
        # part of JAX's cache key, and pathwaysutils checks both outside and inside
        # its ``jax.default_device`` (a recompile for each, otherwise).
        with jax.default_device(None):
            return _for(devices)(test_input)


def install() -> None:
    """Make :class:`CachedSliceHealthChecker` pathwaysutils' default checker, for
    good (a process that never gives pathwaysutils back, as the demo's); prefer
    :func:`patched`."""
    pw_elastic.DefaultSliceHealthChecker = CachedSliceHealthChecker


def group_consecutive(devices_per_slice: int, order: Sequence[jax.Device] | None = None
                      ) -> Callable[[Sequence[jax.Device]], Mapping[int, Sequence[jax.Device]]]:
    """A ``get_slice_to_devices`` for devices without ``slice_index``: slice ``i`` is
    devices ``i*n .. i*n+n-1`` of ``order`` (default: ``jax.devices()`` by id)."""
    ranked = {d.id: i for i, d in enumerate(
        order if order is not None else sorted(jax.devices(), key=lambda d: d.id))}

    def slice_to_devices(devices: Sequence[jax.Device]) -> Mapping[int, Sequence[jax.Device]]:
        out: dict[int, list[jax.Device]] = {}
        for d in devices:
            out.setdefault(ranked[d.id] // devices_per_slice, []).append(d)
        return out

    return slice_to_devices


@contextlib.contextmanager
def patched(*, devices_per_slice: int | None = None,
            slice_to_devices: Callable[[Sequence[jax.Device]],
                                       Mapping[int, Sequence[jax.Device]]] | None = None,
            cached_health_check: bool = True) -> Iterator[None]:
    """pathwaysutils with the slice grouping (``devices_per_slice`` consecutive
    devices, or ``slice_to_devices``; neither: left as it is) and the cached health
    check installed for the body; whatever was there before is put back after."""
    if devices_per_slice is not None and slice_to_devices is not None:
        raise ValueError("give devices_per_slice or slice_to_devices, not both")
    grouping = slice_to_devices or (group_consecutive(devices_per_slice)
                                    if devices_per_slice is not None else None)
    saved_grouping = pw_elastic.get_slice_to_devices
    saved_checker = pw_elastic.DefaultSliceHealthChecker
    try:
        if grouping is not None:
            pw_elastic.get_slice_to_devices = grouping
        if cached_health_check:
            pw_elastic.DefaultSliceHealthChecker = CachedSliceHealthChecker
        yield
    finally:
        pw_elastic.get_slice_to_devices = saved_grouping
        pw_elastic.DefaultSliceHealthChecker = saved_checker
