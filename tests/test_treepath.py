"""mtc.treepath: key paths encoded and rebuilt, and non-array leaves round-tripped
exactly through the manifest's tagged JSON."""

from __future__ import annotations

import json
import math
from typing import Any

import jax
import numpy as np
import pytest

from mtc import treepath
from mtc.errors import ManifestError, UnsupportedLeafError


@pytest.mark.parametrize("value", [
    None, True, False, 0, -7, 2**80, 1.5, -0.0, math.inf, 1e-310, complex(1.25, -3.0),
    "héllo", b"\x00\xff", np.int8(-3), np.uint64(2**63 + 5), np.float32(0.1),
    np.bool_(True), np.complex64(1 - 2j),
])
def test_plain_values_round_trip_exactly(value: Any) -> None:
    encoded = treepath.encode_value(value, "['v']")
    back = treepath.decode_value(json.loads(json.dumps(encoded)))  # as stored
    assert type(back) is type(value)
    if isinstance(value, float) and math.isnan(value):
        assert math.isnan(back)
    else:
        assert back == value
    if isinstance(value, np.generic):
        assert back.dtype == value.dtype


def test_nan_round_trips() -> None:
    back = treepath.decode_value(treepath.encode_value(float("nan"), "x"))
    assert math.isnan(back)


def test_an_unsupported_leaf_names_its_path_and_type() -> None:
    with pytest.raises(UnsupportedLeafError, match=r"leaf \['opt'\] has type .*object"):
        treepath.encode_value(object(), "['opt']")


def test_an_unknown_tag_is_a_manifest_error() -> None:
    with pytest.raises(ManifestError, match="unknown value tag"):
        treepath.decode_value({"t": "from-the-future"})


def test_key_paths_rebuild_the_containers_saved() -> None:
    tree = {"params": {"w": 1, "v": 2}, "layers": [{"b": 3}, {"b": 4}], "t": (5, 6),
            "nnx": {3: 7, 1: 8}}
    flat, _ = treepath.flatten(tree)
    items = [(treepath.encode_keys(path), value) for path, value in flat]
    assert [treepath.path_str(p) for p, _ in flat] == [
        "['layers'][0]['b']", "['layers'][1]['b']", "['nnx'][1]", "['nnx'][3]",
        "['params']['v']", "['params']['w']", "['t'][0]", "['t'][1]"]
    rebuilt = treepath.unflatten_from_keys(items)
    # Sequences come back as lists; an int-keyed dict stays one (flax NNX pure dicts).
    assert rebuilt == {"params": {"w": 1, "v": 2}, "layers": [{"b": 3}, {"b": 4}],
                       "t": [5, 6], "nnx": {3: 7, 1: 8}}
    assert isinstance(rebuilt["nnx"], dict)


def test_none_is_a_leaf_and_a_bare_leaf_is_its_own_tree() -> None:
    flat, _ = treepath.flatten({"a": None})
    assert [(treepath.path_str(p), v) for p, v in flat] == [("['a']", None)]
    assert treepath.unflatten_from_keys([((), 42)]) == 42


def test_attribute_and_numpy_keys_are_encoded_plainly() -> None:
    path = (jax.tree_util.GetAttrKey("opt"), jax.tree_util.DictKey(np.int64(4)),
            jax.tree_util.SequenceKey(2))
    assert treepath.encode_keys(path) == (("a", "opt"), ("d", 4), ("i", 2))
