"""A manifest's shard entries are checked field by field as they are parsed: every
malformed field is refused with a ValueError (a ManifestError from the manifest),
and every entry a manifest writes reads back as itself."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtc.manifest import LeafEntry, Manifest, ShardEntry

GOOD: dict[str, Any] = {"index": [[0, 4], [2, 6]], "file": "00001.0.bin", "nbytes": 64,
                        "crc32c": 123}


@given(st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**40)), max_size=4),
       st.integers(0, 2**40), st.integers(0, 2**32 - 1))
def test_every_written_entry_reads_back_as_itself(pairs: list[tuple[int, int]], nbytes: int,
                                                  crc: int) -> None:
    e = ShardEntry(tuple(pairs), "00003.1.bin", nbytes, crc)
    assert ShardEntry.from_json(e.to_json()) == e


@pytest.mark.parametrize("field,bad", [
    ("index", "0:4"), ("index", [[0, 4, 8]]), ("index", [[0]]), ("index", [(0, 4)]),
    ("index", [[True, 4]]), ("index", [[0, 4.0]]), ("index", [[-1, 4]]), ("index", [[0, "4"]]),
    ("index", [[0, None]]), ("nbytes", True), ("nbytes", -1), ("nbytes", 64.0),
    ("nbytes", "64"), ("crc32c", False), ("crc32c", 2**32), ("crc32c", -1),
    ("crc32c", 1.5), ("file", "../x"), ("file", "a/b"), ("file", ""), ("file", ".."),
    ("file", 7), ("file", "a\x00b"),
])
def test_a_malformed_field_is_refused(field: str, bad: Any) -> None:
    with pytest.raises(ValueError):
        ShardEntry.from_json({**GOOD, field: bad})


def test_a_missing_field_or_a_non_object_is_refused() -> None:
    for field in GOOD:
        with pytest.raises(KeyError):
            ShardEntry.from_json({k: v for k, v in GOOD.items() if k != field})
    with pytest.raises(ValueError, match="not an object"):
        ShardEntry.from_json([GOOD])  # type: ignore[arg-type]


def test_a_manifest_with_a_malformed_shard_names_it() -> None:
    leaf = LeafEntry(path="w", keys=(("d", "w"),), kind="array", shape=(4, 8), dtype="float32",
                     shards=(ShardEntry(((0, 4), (0, 8)), "00001.bin", 128, 5),))
    good = Manifest(step=1, host=0, slice=0, num_hosts=1, leaves=(leaf,))
    assert Manifest.from_bytes(good.to_bytes()) == good
    bad = Manifest(step=1, host=0, slice=0, num_hosts=1, leaves=(
        LeafEntry(path="w", keys=(("d", "w"),), kind="array", shape=(4, 8), dtype="float32",
                  shards=(ShardEntry(((0, 4), (0, 8)), "00001.bin", True, 5),)),))  # type: ignore[arg-type]
    from mtc.errors import ManifestError

    with pytest.raises(ManifestError, match="nbytes True is not an integer"):
        Manifest.from_bytes(bad.to_bytes(), path="/x/manifest.json")
