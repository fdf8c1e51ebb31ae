"""Fuzzing restore planning: random meshes, target shardings, shapes and saved
layouts (any grid of saved shards, each held by one or two hosts). Every device's
region is planned exactly once, its pieces cover it exactly once and overlap it,
and reading the plan from real files gives exactly the saved values."""

from __future__ import annotations

import itertools

import fuzzing  # noqa: F401  (hypothesis profiles)
import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mtc.integrity import crc32c
from mtc.manifest import Index, LeafEntry, ShardEntry
from mtc.restore.plan import Planner, SavedStep
from mtc.sidecar.restore.load import ShardLoader
from mtc.topology import Topology

MESHES = [((8,), ("a",)), ((2, 4), ("a", "b")), ((4, 2), ("a", "b")), ((2, 2, 2), ("a", "b", "c"))]


def _inter(a: Index, b: Index) -> int:
    v = 1
    for (x0, x1), (y0, y1) in zip(a, b, strict=True):
        v *= max(0, min(x1, y1) - max(x0, y0))
    return v


def _vol(a: Index) -> int:
    return int(np.prod([y - x for x, y in a])) if a else 1


@st.composite
def cases(draw: st.DrawFn) -> tuple[Mesh, P, tuple[int, ...], list[tuple[Index, list[int]]]]:
    dims, names = draw(st.sampled_from(MESHES))
    mesh = Mesh(np.array(jax.devices()).reshape(dims), names)
    ndim = draw(st.integers(0, 3))
    free = list(names)
    spec, shape = [], []
    for _ in range(ndim):
        axis = draw(st.sampled_from([None, *free]))
        if axis is not None:
            free.remove(axis)
        size = mesh.shape[axis] if axis else 1
        spec.append(axis)
        shape.append(size * draw(st.integers(1, 3)))
    # The saved layout: a grid, cut anywhere on each axis, each block on 1-2 hosts.
    cuts = []
    for n in shape:
        inner = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
        cuts.append([0, *inner, n])
    blocks = []
    for combo in itertools.product(*[list(itertools.pairwise(c)) for c in cuts]):
        hosts = draw(st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True))
        blocks.append((tuple(combo), hosts))
    return mesh, P(*spec), tuple(shape), blocks


@given(cases())
def test_plan_covers_every_region_exactly_once(tmp_path_factory: pytest.TempPathFactory,
                                               case: tuple[Mesh, P, tuple[int, ...],
                                                           list[tuple[Index, list[int]]]]
                                               ) -> None:
    mesh, spec, shape, blocks = case
    base = tmp_path_factory.mktemp("plan")
    whole = np.arange(int(np.prod(shape)) if shape else 1, dtype=np.float32).reshape(shape)
    holders: dict[Index, list[tuple[int, ShardEntry]]] = {}
    for i, (index, hosts) in enumerate(blocks):
        data = np.ascontiguousarray(whole[tuple(slice(a, b) for a, b in index)]).tobytes()
        entry = ShardEntry(index, f"b{i}.bin", len(data), crc32c(data))
        for h in hosts:
            d = base / f"host-{h}" / "1"
            d.mkdir(parents=True, exist_ok=True)
            (d / entry.file).write_bytes(data)
            holders.setdefault(index, []).append((h, entry))
    leaf = LeafEntry("x", (("d", "x"),), "array", shape, "float32",
                     shards=tuple(e for hs in holders.values() for _, e in hs[:1]))
    topo = Topology(host_of_device={d.id: d.id // 2 for d in jax.devices()},
                    slice_of_host={h: h // 2 for h in range(4)},
                    local_hosts=(0, 1, 2, 3), subdirs=True)
    planner = Planner(SavedStep(1, {}, [holders]), topo)
    sharding = NamedSharding(mesh, spec)
    tasks = planner.tasks_for(0, leaf, sharding, shape)
    loader = ShardLoader(1, lambda h: base / f"host-{h}")

    planned: dict[int, Index] = {}
    for host, host_tasks in tasks.items():
        for t in host_tasks:
            for dev in t.device_ids:
                assert dev not in planned, f"device {dev} planned twice"
                assert dev // 2 == host  # read by the device's own host
                planned[dev] = t.index
            # The pieces overlap the region, not each other, and cover all of it.
            assert all(_inter(p.entry.index, t.index) > 0 or _vol(t.index) == 0
                       for p in t.pieces)
            for a, b in itertools.combinations(t.pieces, 2):
                assert _inter(a.entry.index, b.entry.index) == 0
            assert sum(_inter(p.entry.index, t.index) for p in t.pieces) == _vol(t.index)
            got = loader.read(t)
            np.testing.assert_array_equal(got, whole[tuple(slice(a, b) for a, b in t.index)])
    loader.close()
    want = sharding.devices_indices_map(shape)
    assert set(planned) == {d.id for d in want}
