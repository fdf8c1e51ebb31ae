"""Which distinct shards each host writes, and remembering that per array layout."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mtc import shards
from mtc.shards import ShardPlans, distinct_shards

TWO_PER_HOST = {d.id: d.id // 2 for d in jax.devices()}


def _put(mesh: Mesh, spec: P, shape: tuple[int, ...] = (8, 16)) -> jax.Array:
    return jax.device_put(np.zeros(shape, np.float32), NamedSharding(mesh, spec))


def test_replicas_on_one_host_are_written_once(mesh: Mesh) -> None:
    # mesh: ("replica", "model") = (2, 4); a host holds two devices of one slice.
    by_host: dict[int, list[tuple[tuple[int, int], ...]]] = {}
    for _, h, index, _ in distinct_shards(_put(mesh, P(None, "model")), TWO_PER_HOST):
        by_host.setdefault(h, []).append(index)
    # Columns split 4 ways within a slice, the same in both slices: each host
    # writes its own two column blocks, once.
    assert by_host == {0: [((0, 8), (0, 4)), ((0, 8), (4, 8))],
                       1: [((0, 8), (8, 12)), ((0, 8), (12, 16))],
                       2: [((0, 8), (0, 4)), ((0, 8), (4, 8))],
                       3: [((0, 8), (8, 12)), ((0, 8), (12, 16))]}
    replicated = distinct_shards(_put(mesh, P()), TWO_PER_HOST)
    assert [(h, index) for _, h, index, _ in replicated] == [
        (h, ((0, 8), (0, 16))) for h in range(4)]


def test_plans_are_remembered_per_layout_and_host_map(mesh: Mesh) -> None:
    plans = ShardPlans()
    a, b = _put(mesh, P(None, "model")), _put(mesh, P(None, "model"))
    first = plans(a, TWO_PER_HOST)
    assert first == distinct_shards(a, TWO_PER_HOST)
    assert plans(b, TWO_PER_HOST) is first  # another array of the same layout
    assert plans(_put(mesh, P(None, "model"), (8, 32)), TWO_PER_HOST) is not first
    assert plans(_put(mesh, P("replica", "model")), TWO_PER_HOST) is not first
    # The same devices numbered as other hosts' (a colocated worker's own ids):
    # worked out anew, not the other map's answer.
    one_per_host = {d.id: d.id for d in jax.devices()}
    other = plans(a, one_per_host)
    assert other == distinct_shards(a, one_per_host) != first


def test_plans_kept_are_bounded(mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shards, "PLANS_KEPT", 3)
    plans = ShardPlans()
    arrays = [_put(mesh, P(None, "model"), (8, 16 * (i + 1))) for i in range(5)]
    for x in arrays:
        plans(x, TWO_PER_HOST)
    assert len(plans._plans) <= 3
    assert plans(arrays[-1], TWO_PER_HOST) == distinct_shards(arrays[-1], TWO_PER_HOST)
