"""Device loss on CPU: pathwaysutils' fault simulator, made safe for freed arrays."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax
from pathwaysutils.test.mock_fault_injection import DeviceLossSimulator


class SliceLossSimulator(DeviceLossSimulator):
    """``DeviceLossSimulator`` that copes with freed and donated arrays.

    The simulator keys arrays by ``id()``; CPython reuses the id of a freed
    array for a new one, which then inherited the old array's devices and
    "lost" state: healthy arrays on the surviving slice raised DATA_LOSS. Each
    id is checked against a weak reference to the array it was recorded for.
    Its patched ``jax.jit`` also asks the inputs for their devices after the
    call, which raises for donated (deleted) inputs.
    """

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, weakref.ref[Any]] = {}

    def _fresh(self, arr: Any) -> None:
        if not isinstance(arr, jax.Array) or isinstance(arr, jax.core.Tracer):
            return
        i = id(arr)
        ref = self._refs.get(i)
        if ref is not None and ref() is arr:
            return
        self._array_devices.pop(i, None)
        self._array_generation.pop(i, None)
        self._corrupted_array_ids.discard(i)
        try:
            self._refs[i] = weakref.ref(arr)
        except TypeError:
            self._refs.pop(i, None)

    def track_array(self, arr: Any) -> None:
        if _deleted(arr):
            return  # a donated input: its devices can no longer be asked
        self._fresh(arr)
        super().track_array(arr)

    def is_array_corrupted(self, arr: Any) -> bool:
        if _deleted(arr):
            return id(arr) in self._corrupted_array_ids
        self._fresh(arr)
        return bool(super().is_array_corrupted(arr))

    def bind_array_to_devices(self, arr: Any, devices: Sequence[jax.Device]) -> None:
        self._fresh(arr)
        super().bind_array_to_devices(arr, devices)


def _deleted(arr: Any) -> bool:
    return (isinstance(arr, jax.Array) and not isinstance(arr, jax.core.Tracer)
            and arr.is_deleted())
