"""The per-host manifest of a committed step: versioned dataclasses stored as JSON.

Each host's step folder holds one ``manifest.json`` describing the whole tree
(paths, kinds, global shapes, dtypes, shardings, non-array values) and the
shard files that this host wrote, with their indices, sizes and CRC32C. The
manifest carries a checksum of its own body, so a damaged manifest is detected
like a damaged shard. Never pickle: a manifest is readable by any tool.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from mtc.errors import ManifestError
from mtc.integrity import crc32c

FORMAT = "mtc-manifest"
VERSION = 1
MANIFEST_NAME = "manifest.json"

LeafKind = Literal["array", "numpy", "prng_key", "value"]
# One (start, stop) pair per dimension, in global coordinates.
Index = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One file holding the ``index`` region of a leaf."""

    index: Index
    file: str
    nbytes: int
    crc32c: int

    def to_json(self) -> dict[str, Any]:
        return {"index": [list(p) for p in self.index], "file": self.file,
                "nbytes": self.nbytes, "crc32c": self.crc32c}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardEntry:
        return cls(tuple((int(a), int(b)) for a, b in d["index"]), str(d["file"]),
                   int(d["nbytes"]), int(d["crc32c"]))


@dataclasses.dataclass(frozen=True)
class LeafEntry:
    """One leaf of the saved tree.

    ``keys`` is the leaf's key path as ``[kind, key]`` pairs (kind ``"d"`` dict
    key, ``"i"`` sequence index, ``"a"`` attribute), enough to rebuild nested
    containers without a target. ``value`` holds a non-array leaf, encoded by
    :mod:`mtc.treepath`.
    """

    path: str
    keys: tuple[tuple[str, Any], ...]
    kind: LeafKind
    shape: tuple[int, ...] = ()
    dtype: str = ""
    sharding: dict[str, Any] | None = None
    key_impl: str | None = None
    value: Any = None
    shards: tuple[ShardEntry, ...] = ()

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "keys": [list(k) for k in self.keys],
                             "kind": self.kind}
        if self.kind == "value":
            d["value"] = self.value
            return d
        d.update(shape=list(self.shape), dtype=self.dtype, sharding=self.sharding,
                 shards=[s.to_json() for s in self.shards])
        if self.key_impl is not None:
            d["key_impl"] = self.key_impl
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LeafEntry:
        return cls(
            path=str(d["path"]),
            keys=tuple((str(k), v) for k, v in d["keys"]),
            kind=d["kind"],
            shape=tuple(int(x) for x in d.get("shape", ())),
            dtype=str(d.get("dtype", "")),
            sharding=d.get("sharding"),
            key_impl=d.get("key_impl"),
            value=d.get("value"),
            shards=tuple(ShardEntry.from_json(s) for s in d.get("shards", ())),
        )


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What one host committed for one step."""

    step: int
    host: int
    slice: int
    num_hosts: int
    leaves: tuple[LeafEntry, ...]
    version: int = VERSION

    @property
    def files(self) -> dict[str, ShardEntry]:
        return {s.file: s for leaf in self.leaves for s in leaf.shards}

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for leaf in self.leaves for s in leaf.shards)

    def to_bytes(self) -> bytes:
        body = {"format": FORMAT, "version": self.version, "step": self.step,
                "host": self.host, "slice": self.slice, "num_hosts": self.num_hosts,
                "leaves": [leaf.to_json() for leaf in self.leaves]}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return json.dumps({"body": text, "crc32c": crc32c(text.encode())}).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, path: str = "") -> Manifest:
        try:
            outer = json.loads(data)
            text = outer["body"]
            if crc32c(text.encode()) != outer["crc32c"]:
                raise ManifestError("manifest checksum mismatch", path=path)
            body = json.loads(text)
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise ManifestError(f"unreadable manifest: {e}", path=path) from e
        if body.get("format") != FORMAT:
            raise ManifestError(f"not an mtc manifest (format={body.get('format')!r})", path=path)
        if body.get("version") != VERSION:
            raise ManifestError(
                f"manifest version {body.get('version')} is not supported "
                f"(this mtc reads {VERSION})",
                path=path)
        try:
            return cls(step=int(body["step"]), host=int(body["host"]), slice=int(body["slice"]),
                       num_hosts=int(body["num_hosts"]),
                       leaves=tuple(LeafEntry.from_json(x) for x in body["leaves"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"malformed manifest: {e}", path=path) from e
