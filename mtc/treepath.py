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

from mtc.errors import UnsupportedLeafError

KeyPath = tuple[Any, ...]


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
            if not isinstance(key, (str, int)):
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


def unflatten_from_keys(items: Sequence[tuple[Sequence[tuple[str, Any]], Any]]) -> Any:
    """Rebuild nested dicts and lists from encoded key paths (restore without target)."""
    if len(items) == 1 and not items[0][0]:
        return items[0][1]
    root: dict[Any, Any] = {}
    for keys, value in items:
        node = root
        for i, (_, key) in enumerate(keys):
            if i == len(keys) - 1:
                node[key] = value
            else:
                node = node.setdefault(key, {})
    return _lists_from_index_dicts(root, items)


def _lists_from_index_dicts(node: Any, items: Any) -> Any:
    if not isinstance(node, dict):
        return node
    converted = {k: _lists_from_index_dicts(v, items) for k, v in node.items()}
    keys = list(converted)
    if keys and all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))):
        return [converted[i] for i in range(len(keys))]
    return converted


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
    raise ValueError(f"unknown value tag {t!r}")
