"""Controller device ids resolved on a worker as Pathways' runtime resolves them, by
Orbax's own code.

On Pathways a colocated program names CPU devices by backend-global ids that the
worker's own CPU backend numbers differently; the worker's devices show the global
id only in their repr (``CpuDevice(id=0)[PjRtIFRTDeviceId=120]``). Orbax's patch
of JAX's deserializer (:func:`mtc.sidecar.colocated.install_cpu_id_patch`) parses
those reprs into an id -> device map, refusing an ambiguous one. The local
cluster's sidecar shows its devices to that same code shaped as Pathways shows
them, so that what resolves a program's ids here is Orbax's parser, not a map of
mtc's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mtc.errors import ColocatedCallError


class PathwaysShaped:
    """A device as a Pathways worker's runtime shows it: its own local id, and the
    backend-global id the controller knows it by in its repr."""

    def __init__(self, device: Any, global_id: int) -> None:
        self.device = device
        self.id = device.id
        self.platform = device.platform
        self.client = device.client
        self.global_id = global_id

    def __repr__(self) -> str:
        return f"CpuDevice(id={self.device.id})[PjRtIFRTDeviceId={self.global_id}]"


def _orbax_map_builder() -> tuple[Any, Callable[[], Mapping[int, Any]]] | None:
    """Orbax's colocated transport module and its (uncached) map builder, or None
    where this Orbax has none."""
    try:
        from orbax.checkpoint._src.multihost import colocated_transport as ct
    except ImportError:
        return None
    build = getattr(getattr(ct, "_get_cpu_device_map", None), "__wrapped__", None)
    if build is None or not callable(getattr(ct, "_all_backend_devices", None)):
        return None
    return ct, build


def resolve(wanted: Mapping[int, Any]) -> dict[int, Any]:
    """``wanted`` (the controller's id -> this process's device) as Orbax's map
    builder resolves it from the devices shown Pathways-shaped: the same map, or a
    :class:`ColocatedCallError` where Orbax's code refuses it (an ambiguous id) or
    resolves an id elsewhere. Where Orbax has no such code, ``wanted`` as it is.
    Callers serialize: this swaps a module attribute of Orbax's for the call."""
    found = _orbax_map_builder()
    if found is None:
        return dict(wanted)
    ct, build = found
    shown = tuple(PathwaysShaped(d, cid) for cid, d in wanted.items())
    saved = ct._all_backend_devices
    ct._all_backend_devices = lambda: shown
    try:
        resolved = build()
    except ValueError as e:
        raise ColocatedCallError(f"the program's device ids do not resolve on this host "
                                 f"as on a Pathways worker: {e}") from e
    finally:
        ct._all_backend_devices = saved
    out = {}
    for cid, device in wanted.items():
        got = resolved.get(cid)
        if not isinstance(got, PathwaysShaped) or got.device is not device:
            raise ColocatedCallError(f"controller device id {cid} resolves to {got!r} on "
                                     f"this host, not to {device!r}")
        out[cid] = device
    return out
