"""Placing a pytree of arrays onto other shardings from the shards on healthy devices:
:mod:`mtc.elastic.placement` for a pytree (the benchmarks place whole states, and a
test of the snapshot the placed arrays). Not the wheel's: no user of mtc needs it."""

from __future__ import annotations

from collections.abc import Set
from typing import Any

import jax

from mtc.elastic.placement import Shards
from mtc.elastic.placement import place as place_shards


def place(arrays: Any, shardings: Any, healthy: Set[int]) -> Any:
    """The pytree ``arrays`` laid out per the matching pytree ``shardings``, read
    only from shards on the devices whose ids are in ``healthy``."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(arrays)
    targets = jax.tree_util.tree_structure(arrays).flatten_up_to(shardings)  # type: ignore[attr-defined]
    placed = place_shards([Shards.of(a) for _, a in leaves], targets,
                          [jax.tree_util.keystr(p) for p, _ in leaves], healthy)
    return jax.tree_util.tree_unflatten(treedef, placed)
