"""Pytree paths and the encoding of non-array leaves.

Leaves are matched between a saved tree and a restore target by their key path
string (``jax.tree_util.keystr``), so a target may hold its leaves in any
container type that produces the same paths. Non-array leaves are stored in the
manifest as tagged JSON that round-trips exactly (floats as hex, big ints as
decimal strings, numpy scalars as raw bytes).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mtc.errors import ManifestError, UnsupportedLeafError

KeyPath = tuple[Any, ...]
# Leaves of ``save(..., metrics=...)`` are kept in the step's manifest under this
# path prefix; no pytree path starts with it (keystr paths start with '[' or '.').
METRICS_ROOT = "@metrics"
# The item names of a step saved as an Orbax ``Composite`` (one value leaf), so that
# restoring it without a target gives a ``Composite`` back, as Orbax's does.
ITEMS_ROOT = "@items"
# Orbax's ``save(custom_metadata=)`` of a step (one value leaf, JSON text), read back by
# ``metadata(step).custom_metadata``.
CUSTOM_ROOT = "@custom"
# When the step's save began (seconds since the epoch, on the clock Orbax reads): what
# keep_time_interval and Orbax's time-based policies need of a step saved before this
# manager (a restarted job), one value leaf.
SAVED_AT_ROOT = "@saved_at"


def is_own_leaf(path: str) -> bool:
    """Whether a manifest leaf is mtc's own (metrics, item names), not the state's."""
    return path.startswith("@")


def _is_leaf(x: Any) -> bool:
    return x is None


def flatten(tree: Any) -> tuple[list[tuple[KeyPath, Any]], Any]:
    """Leaves with their key paths (``None`` kept as a leaf), and the treedef."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)


def path_str(path: KeyPath) -> str:
    return jax.tree_util.keystr(path)


def encode_keys(path: KeyPath) -> tuple[tuple[str, Any], ...]:
    out: list[tuple[str, Any]] = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            key = k.key
            if isinstance(key, np.integer):
                key = int(key)
            elif not isinstance(key, (str, int)) or isinstance(key, bool):
                key = str(key)
            out.append(("d", key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(("i", k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(("a", k.name))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(("i", k.key))
        else:
            out.append(("d", str(k)))
    return tuple(out)


class _Branch(dict):
    """An inner node while rebuilding a tree: keys are (kind, key) pairs."""


def unflatten_from_keys(items: Sequence[tuple[Sequence[Sequence[Any]], Any]], *,
                        str_keys: bool = False) -> Any:
    """Rebuild nested dicts and lists from encoded key paths (restore without target).

    Sequence keys become lists; dict and attribute keys stay dict keys of the
    type saved (an int-keyed dict, as flax NNX's pure dicts, stays a dict), or
    with ``str_keys`` become strings, as Orbax gives them."""
    if len(items) == 1 and not items[0][0]:
        return items[0][1]
    root = _Branch()
    for keys, value in items:
        node = root
        for i, (kind, key) in enumerate(keys):
            k = ("i" if kind == "i" else "d", key)
            if i == len(keys) - 1:
                node[k] = value
            else:
                node = node.setdefault(k, _Branch())
    return _build(root, str_keys)


def _build(node: Any, str_keys: bool = False) -> Any:
    if not isinstance(node, _Branch):
        return node
    if node and all(kind == "i" for kind, _ in node):
        return [_build(node[k], str_keys) for k in sorted(node, key=lambda k: k[1])]
    return {str(key) if str_keys else key: _build(v, str_keys) for (_, key), v in node.items()}


def encode_value(x: Any, path: str) -> dict[str, Any]:
    """Tagged JSON for a non-array leaf; raises UnsupportedLeafError otherwise."""
    if x is None:
        return {"t": "none"}
    if isinstance(x, bool):
        return {"t": "bool", "v": bool(x)}
    if isinstance(x, int) and not isinstance(x, bool):
        return {"t": "int", "v": str(x)}
    if isinstance(x, float):
        return {"t": "float", "v": float.hex(x)}
    if isinstance(x, complex):
        return {"t": "complex", "v": [float.hex(x.real), float.hex(x.imag)]}
    if isinstance(x, str):
        return {"t": "str", "v": x}
    if isinstance(x, bytes):
        return {"t": "bytes", "v": base64.b64encode(x).decode()}
    if isinstance(x, np.generic) and x.dtype.kind in "biufcmM":
        return {"t": "np", "dtype": x.dtype.str, "v": base64.b64encode(x.tobytes()).decode()}
    raise UnsupportedLeafError(
        f"leaf {path} has type {type(x).__module__}.{type(x).__qualname__}, which mtc cannot save; "
        "supported: jax.Array, numpy arrays and scalars, int, float, complex, bool, str, "
        "bytes, None")


def decode_value(d: dict[str, Any]) -> Any:
    t = d["t"]
    if t == "none":
        return None
    if t == "bool":
        return bool(d["v"])
    if t == "int":
        return int(d["v"])
    if t == "float":
        return float.fromhex(d["v"])
    if t == "complex":
        return complex(float.fromhex(d["v"][0]), float.fromhex(d["v"][1]))
    if t == "str":
        return str(d["v"])
    if t == "bytes":
        return base64.b64decode(d["v"])
    if t == "np":
        return np.frombuffer(base64.b64decode(d["v"]), dtype=np.dtype(d["dtype"]))[0]
    raise ManifestError(f"unknown value tag {t!r} in a manifest (written by a newer mtc?)")
