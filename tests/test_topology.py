"""Host identity from device attributes, with stub devices shaped like each platform's.

Stubs stand in for TPU devices behind a Pathways controller, which cannot run
here: they carry exactly the attributes the real devices report (every
``process_index`` 0 on Pathways; slice and task attributes), nothing more.
"""

from __future__ import annotations

import dataclasses

import pytest

from mtc.errors import ConfigError
from mtc.options import Options
from mtc.topology import Topology, pathways_worker


@dataclasses.dataclass(frozen=True)
class PathwaysDevice:
    id: int
    slice_index: int
    virtual_task_index: int
    process_index: int = 0
    platform: str = "tpu"


@dataclasses.dataclass(frozen=True)
class ReprOnlyDevice:
    """An older runtime: the task appears only in the device's repr."""

    id: int
    slice_index: int
    task: int
    process_index: int = 0

    def __repr__(self) -> str:
        return f"TpuDevice(id={self.id}, slice={self.slice_index}, logical_task={self.task})"


@dataclasses.dataclass(frozen=True)
class McDevice:
    id: int
    process_index: int
    platform: str = "gpu"


def _pathways_devices(slices: int, hosts: int, per_host: int) -> list[PathwaysDevice]:
    # Ids interleave hosts on purpose, so that ranking by id would be wrong.
    out = []
    for s in range(slices):
        for h in range(hosts):
            for k in range(per_host):
                out.append(PathwaysDevice(id=1000 * s + k * hosts + h, slice_index=s,
                                          virtual_task_index=h))
    return out


def test_pathways_two_slices_of_two_hosts_are_four_workers_ranked_slice_major() -> None:
    devices = _pathways_devices(2, 2, 4)
    topo = Topology.detect(devices, Options(), pathways=True)  # type: ignore[arg-type]
    assert topo.num_hosts == 4
    assert topo.num_slices == 2
    assert topo.slice_of_host == {0: 0, 1: 0, 2: 1, 3: 1}
    for d in devices:
        assert topo.host_of_device[d.id] == 2 * d.slice_index + d.virtual_task_index
    assert topo.local_hosts == (0, 1, 2, 3)  # the controller serves every worker
    assert topo.subdirs is False  # each worker has a RAM disk of its own


def test_pathways_ranks_do_not_depend_on_device_order() -> None:
    devices = _pathways_devices(3, 2, 2)
    a = Topology.detect(devices, Options(), pathways=True)  # type: ignore[arg-type]
    b = Topology.detect(devices[::-1], Options(), pathways=True)  # type: ignore[arg-type]
    assert a == b
    assert sorted(set(a.host_of_device.values())) == list(range(6))


def test_pathways_task_from_repr() -> None:
    devices = [ReprOnlyDevice(id=i, slice_index=i // 4, task=(i // 2) % 2) for i in range(8)]
    topo = Topology.detect(devices, Options(), pathways=True)  # type: ignore[arg-type]
    assert topo.host_of_device == {i: i // 2 for i in range(8)}
    assert pathways_worker(devices[5]) == (1, 0)


def test_pathways_device_without_task_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Bare:
        id: int
        slice_index: int = 0
        process_index: int = 0

    with pytest.raises(ConfigError, match="Pathways worker"):
        Topology.detect([Bare(0), Bare(1)], Options(), pathways=True)  # type: ignore[arg-type]


def test_multi_controller_hosts_are_processes() -> None:
    devices = [McDevice(id=i, process_index=i // 2) for i in range(8)]
    topo = Topology.detect(devices, Options(hosts_per_slice=2))  # type: ignore[arg-type]
    assert topo.host_of_device == {i: i // 2 for i in range(8)}
    assert topo.slice_of_host == {0: 0, 1: 0, 2: 1, 3: 1}
