"""Fuzzing the parsers of untrusted input: manifests, replicator.yaml, restore
marker names, and backup listings and manifests read from a bucket. Whatever the
bytes, the only exception is a typed :class:`~mtc.errors.MtcError`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import fuzzing  # noqa: F401  (hypothesis profiles)
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtc.errors import MtcError
from mtc.integrity import crc32c
from mtc.manifest import Manifest
from mtc.sidecar.backup.job import BackupStore
from mtc.sidecar.backup.local import LocalBackend
from mtc.sidecar.replicator import orbax

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                      st.floats(allow_nan=True), st.text(max_size=20))
json_any = st.recursive(json_leaf, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.text(max_size=10), c, max_size=5)),
    max_leaves=25)


def good_manifest() -> bytes:
    from mtc.manifest import LeafEntry, ShardEntry
    shard = ShardEntry(((0, 4), (0, 2)), "00000.0-4_0-2.bin", 32, 123)
    leaves = (LeafEntry("w", (("d", "w"),), "array", (4, 2), "float32", None, None, None,
                        (shard,)),
              LeafEntry("n", (("d", "n"),), "value", value=3))
    return Manifest(7, 0, 0, 1, leaves).to_bytes()


def sealed(body: Any) -> bytes:
    """A manifest whose own checksum is right, so parsing goes past it."""
    text = json.dumps(body)
    return json.dumps({"body": text, "crc32c": crc32c(text.encode())}).encode()


def parse_manifest(data: bytes) -> None:
    try:
        Manifest.from_bytes(data, path="fuzz/manifest.json")
    except MtcError:
        pass


def test_good_manifest_parses() -> None:
    m = Manifest.from_bytes(good_manifest())
    assert m.step == 7 and m.files["00000.0-4_0-2.bin"].nbytes == 32


@given(st.binary(max_size=300))
def test_manifest_random_bytes(data: bytes) -> None:
    parse_manifest(data)


@given(st.data())
def test_manifest_mutated(data: st.DataObject) -> None:
    raw = bytearray(good_manifest())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    parse_manifest(bytes(raw[:data.draw(st.integers(0, len(raw)))]))


@given(json_any)
def test_manifest_any_sealed_body(body: Any) -> None:
    parse_manifest(sealed(body))


def _body_variants() -> st.SearchStrategy[dict[str, Any]]:
    base = json.loads(json.loads(good_manifest())["body"])
    keys = ["format", "version", "step", "host", "slice", "num_hosts", "leaves"]
    leaf_keys = ["path", "keys", "kind", "shape", "dtype", "sharding", "shards", "value"]
    shard_keys = ["index", "file", "nbytes", "crc32c"]

    @st.composite
    def variant(draw: st.DrawFn) -> dict[str, Any]:
        body = json.loads(json.dumps(base))
        for k in draw(st.lists(st.sampled_from(keys), max_size=2)):
            body[k] = draw(json_any)
        leaf = body["leaves"][0] if isinstance(body.get("leaves"), list) and body["leaves"] \
            and isinstance(body["leaves"][0], dict) else None
        if leaf is not None:
            for k in draw(st.lists(st.sampled_from(leaf_keys), max_size=2)):
                leaf[k] = draw(json_any)
            shards = leaf.get("shards")
            if isinstance(shards, list) and shards and isinstance(shards[0], dict):
                for k in draw(st.lists(st.sampled_from(shard_keys), max_size=2)):
                    shards[0][k] = draw(st.one_of(json_any, st.just("../../etc/passwd"),
                                                  st.just([[0, 9], [0, 2]]),
                                                  st.just([[3, 1], [0, 2]])))
        return body

    return variant()


@given(_body_variants())
def test_manifest_fields_mutated(body: dict[str, Any]) -> None:
    try:
        m = Manifest.from_bytes(sealed(body))
    except MtcError:
        return
    # What parses is safe to use: file names stay in the step folder, indices
    # inside the leaf's shape.
    for leaf in m.leaves:
        for s in leaf.shards:
            assert "/" not in s.file and s.file not in ("", ".", "..")
            assert len(s.index) == len(leaf.shape)
            assert all(0 <= a <= b <= d for (a, b), d in zip(s.index, leaf.shape, strict=True))
            assert s.nbytes >= 0 and 0 <= s.crc32c < 2**32


@pytest.mark.parametrize("bad", [b"[]", b"1", b'{"body": 5, "crc32c": 0}', b"[" * 100_000])
def test_manifest_known_bad(bad: bytes) -> None:
    with pytest.raises(MtcError):
        Manifest.from_bytes(bad)


# -- replicator.yaml and restore markers ---------------------------------------------

yaml_text = st.one_of(
    st.text(max_size=200),
    st.dictionaries(st.sampled_from(["job-name", "framework", "node-rank", "nodes",
                                     "peer-ranks", "assume-data-parallelism",
                                     "backup-interval-minutes", "backup-interval-steps"]),
                    json_any, max_size=8).map(json.dumps),  # JSON is YAML
)


@given(yaml_text)
def test_replicator_yaml_any_text(text: str) -> None:
    try:
        req = orbax.parse_request(text)
    except MtcError:
        return
    assert 0 <= req.rank < req.nodes and req.nodes % req.num_slices == 0


@pytest.mark.parametrize("text", ["- a\n- b\n", "nodes: .inf\nnode-rank: 0\njob-name: j\n",
                                  "42", "job-name: j\nnode-rank: 0\nnodes: 0\n"])
def test_replicator_yaml_known_bad(text: str) -> None:
    with pytest.raises(MtcError):
        orbax.parse_request(text)


ORBAX_MARKER = re.compile(r"^.+-s(\d+)-n\d+-w\d+\.restore$")  # Orbax client's pattern


@given(st.text(max_size=30), st.integers(0, 2**40), st.integers(0, 4096))
def test_marker_name_is_what_the_client_parses(job: str, step: int, rank: int) -> None:
    """Any job name replicator.yaml may carry gives a marker Orbax's client finds."""
    try:
        req = orbax.parse_request(json.dumps({"job-name": job, "node-rank": 0, "nodes": 1}))
    except MtcError:
        return
    name = orbax.marker_name(req.job_name, step, rank)
    m = ORBAX_MARKER.match(name)
    assert m is not None and int(m.group(1)) == step


# -- backup listings and manifests from a bucket (the local/file backend) -------------


KEYS = ["steps/1/MANIFEST.json", "steps/x/MANIFEST.json", "steps/2/data/0/a", "steps/3",
        "staging/4-x/MANIFEST.json", "steps/5/MANIFEST.json/extra"]


@given(st.lists(st.tuples(st.sampled_from(KEYS),
                          st.binary(max_size=40)), max_size=6),
       st.one_of(json_any, st.just({"format": "mtc-backup", "version": 1,
                                    "ranks": {"0": [{"path": "../x", "size": 1, "crc32c": 1,
                                                     "sha256": "", "object": "/etc"}]}})))
def test_backup_listing_and_manifest(tmp_path_factory: pytest.TempPathFactory,
                                     objects: list[tuple[str, bytes]], manifest: Any) -> None:
    root = tmp_path_factory.mktemp("bucket")
    for key, data in objects:
        p = root / key
        if p.is_dir():
            continue
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        except (NotADirectoryError, FileExistsError, IsADirectoryError):
            continue
    (root / "steps" / "9").mkdir(parents=True, exist_ok=True)
    (root / "steps" / "9" / "MANIFEST.json").write_text(json.dumps(manifest))
    store = BackupStore(LocalBackend(root.as_uri()))
    try:
        steps = store.committed_steps()
    except MtcError:
        return
    assert all(isinstance(s, int) and s >= 0 for s in steps)
    for s in steps:
        try:
            ranks = store.manifest(s)
        except MtcError:
            continue
        for entries in ranks.values():
            for e in entries:
                assert not e.path.startswith("/") and ".." not in Path(e.path).parts
                assert not e.object.startswith("/") and ".." not in Path(e.object).parts
