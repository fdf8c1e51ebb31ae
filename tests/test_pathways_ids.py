"""The local cluster's sidecar resolves a program's device ids with Orbax's own parser
over devices shown as a Pathways worker shows them."""

from __future__ import annotations

from typing import Any

import pytest

from mtc.errors import ColocatedCallError
from mtc.sidecar.host import pathways_ids


class Device:
    """A worker's CPU device: a local id on its own backend (no real device is needed
    to exercise the parser; JAX's devices cannot be built with other ids)."""

    platform = "cpu"
    client = object()

    def __init__(self, local_id: int) -> None:
        self.id = local_id

    def __repr__(self) -> str:
        return f"CpuDevice(id={self.id})"


def test_global_ids_resolve_through_orbaxs_parser_of_pathways_reprs() -> None:
    mine = [Device(2048 + i) for i in range(4)]
    wanted: dict[int, Any] = {120 + i: d for i, d in enumerate(mine)}
    shown = [repr(pathways_ids.PathwaysShaped(d, cid)) for cid, d in wanted.items()]
    assert shown[0] == "CpuDevice(id=2048)[PjRtIFRTDeviceId=120]"
    assert pathways_ids.resolve(wanted) == wanted


def test_an_id_that_is_both_global_and_local_is_refused() -> None:
    # The device known globally as 6 has local id 7, the other device's global id:
    # Orbax refuses the map.
    a, b = Device(7), Device(8)
    with pytest.raises(ColocatedCallError, match=r"ambiguous"):
        pathways_ids.resolve({6: a, 7: b})
