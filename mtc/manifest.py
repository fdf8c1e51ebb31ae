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
from typing import Any, Literal, NamedTuple

from mtc.errors import ManifestError
from mtc.integrity import crc32c

FORMAT = "mtc-manifest"
# 2 added ``run``, and ``ranks`` where it is not host h = rank h. A reader takes
# every version up to its own (an older step reads as run ""); a step of a newer
# version is refused by name: upgrade readers (the replicators, then the trainers)
# before writers (docs/deploy.md, "Upgrades").
VERSION = 2
READS = (1, 2)
MANIFEST_NAME = "manifest.json"
# A run identity: what the manager's save wrote it with (mtc.runs). Short, plain.
RUN_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_.:")
RUN_MAX = 64

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
        # Checks inlined: a restore parses every host's thousands of shards.
        if type(d) is not dict:
            raise ValueError("shard is not an object")
        raw = d["index"]
        if type(raw) is not list:
            raise ValueError("shard index is not a list")
        pairs = []
        for p in raw:
            # ``type(x) is int``: JSON has no other integer, and a bool is refused.
            if type(p) is not list or len(p) != 2 or type(p[0]) is not int \
                    or type(p[1]) is not int or p[0] < 0 or p[1] < 0:
                _pair(p)  # raises, naming what is wrong
            pairs.append((p[0], p[1]))
        name = d["file"]
        # A shard is a file of its step folder: never a path that leads elsewhere.
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name \
                or "\\" in name or "\x00" in name:
            raise ValueError(f"bad shard file name {name!r}")
        nbytes, crc = d["nbytes"], d["crc32c"]
        if type(nbytes) is not int or nbytes < 0:
            _int(nbytes, "nbytes", 0)
        if type(crc) is not int or not 0 <= crc < 2**32:
            _int(crc, "crc32c", 0, 2**32 - 1)
        return cls(tuple(pairs), name, nbytes, crc)


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
        d = _dict(d, "leaf")
        kind = d["kind"]
        if kind not in KINDS:
            raise ValueError(f"unknown leaf kind {kind!r}")
        keys = []
        for k in _list(d["keys"], "keys"):
            k = _list(k, "key")
            if len(k) != 2:
                raise ValueError(f"bad key {k!r}")
            keys.append((str(k[0]), k[1]))
        shape = tuple(_int(x, "shape", 0) for x in _list(d.get("shape", []), "shape"))
        shards = tuple(ShardEntry.from_json(s) for s in _list(d.get("shards", []), "shards"))
        for s in shards:  # nothing outside the leaf is ever read
            if len(s.index) != len(shape) or any(
                    not 0 <= a <= b <= n for (a, b), n in zip(s.index, shape, strict=True)):
                raise ValueError(f"shard {s.file} index {list(s.index)} is outside "
                                 f"shape {list(shape)}")
        sharding = d.get("sharding")
        key_impl = d.get("key_impl")
        if sharding is not None and not isinstance(sharding, dict):
            raise ValueError("sharding is not an object")
        if key_impl is not None and not isinstance(key_impl, str):
            raise ValueError("key_impl is not a string")
        return cls(path=str(d["path"]), keys=tuple(keys), kind=kind, shape=shape,
                   dtype=str(d.get("dtype", "")), sharding=sharding, key_impl=key_impl,
                   value=d.get("value"), shards=shards)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What one host committed for one step."""

    step: int
    host: int
    slice: int
    num_hosts: int
    leaves: tuple[LeafEntry, ...]
    version: int = VERSION
    # The run that wrote it: every host's manifest of one step names the same run,
    # or the step mixes two runs' bytes and is never restored ("": before version 2).
    run: str = ""
    # The replicator rank of each saving host, in host order (a job that came back
    # on other hosts than 0..n-1): where each host's data of the step is kept.
    # Empty: host h is rank h.
    ranks: tuple[int, ...] = ()

    def rank_of(self, host: int) -> int:
        """The replicator rank holding saving host ``host``'s data of the step."""
        return self.ranks[host] if self.ranks else host

    @property
    def files(self) -> dict[str, ShardEntry]:
        return {s.file: s for leaf in self.leaves for s in leaf.shards}

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for leaf in self.leaves for s in leaf.shards)

    def to_bytes(self) -> bytes:
        body = {"format": FORMAT, "version": self.version, "step": self.step,
                "host": self.host, "slice": self.slice, "num_hosts": self.num_hosts,
                "run": check_run(self.run), "leaves": [leaf.to_json() for leaf in self.leaves]}
        if self.ranks:
            body["ranks"] = list(check_ranks(list(self.ranks), self.num_hosts))
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return json.dumps({"body": text, "crc32c": crc32c(text.encode())}).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, path: str = "") -> Manifest:
        body = cls._body(data, path)
        try:
            m = cls(step=_int(body["step"], "step", 0, STEP_MAX),
                    host=_int(body["host"], "host", 0),
                    slice=_int(body["slice"], "slice", 0),
                    num_hosts=_int(body["num_hosts"], "num_hosts", 1),
                    leaves=tuple(LeafEntry.from_json(x) for x in _list(body["leaves"],
                                                                       "leaves")),
                    version=body["version"], run=check_run(body.get("run", "")),
                    ranks=_ranks(body))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ManifestError(f"malformed manifest: {e!r}"[:500], path=path) from e
        if m.host >= m.num_hosts:
            raise ManifestError(f"host {m.host} of {m.num_hosts}", path=path)
        return m

    @classmethod
    def num_hosts_of(cls, data: bytes, *, path: str = "") -> int:
        """The number of hosts that saved the step (see :meth:`summary_of`)."""
        return cls.summary_of(data, path=path)[0]

    @classmethod
    def summary_of(cls, data: bytes, *, path: str = "") -> Summary:
        """The number of hosts that saved the step, the run that saved it, the
        saving hosts' ranks, whose manifest it is, of which step and the bytes of
        the host's files of it, checked as :meth:`from_bytes` checks the manifest but
        without building its leaves (a replicator asks this of every copy it
        lists; a manifest has thousands of shards)."""
        body = cls._body(data, path)
        try:
            num_hosts = _int(body["num_hosts"], "num_hosts", 1)
            host = _int(body["host"], "host", 0)
            run = check_run(body.get("run", ""))
            ranks = _ranks(body)
            step = _int(body["step"], "step", 0, STEP_MAX)
            nbytes = len(data) + sum(_int(s["nbytes"], "nbytes", 0)
                                     for leaf in _list(body["leaves"], "leaves")
                                     for s in _list(_dict(leaf, "leaf").get("shards", []),
                                                    "shards"))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ManifestError(f"malformed manifest: {e!r}"[:500], path=path) from e
        if host >= num_hosts:
            raise ManifestError(f"host {host} of {num_hosts}", path=path)
        return Summary(num_hosts, run, ranks, host, step, nbytes)

    @classmethod
    def check_bytes(cls, data: bytes, *, path: str = "") -> None:
        """Raise :class:`ManifestError` unless ``data`` is a manifest whose body
        matches its checksum: what tells bytes already summarised (:meth:`summary_of`)
        from bytes changed since, without parsing the body again."""
        cls._text(data, path)

    @staticmethod
    def _text(data: bytes, path: str) -> str:
        """The manifest's body text, its checksum checked."""
        try:
            outer = _dict(json.loads(data), "manifest")
            text = outer["body"]
            if not isinstance(text, str):
                raise ValueError("body is not a string")
            if crc32c(text.encode()) != outer["crc32c"]:
                raise ManifestError("manifest checksum mismatch", path=path)
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            # RecursionError: JSON nested deeper than the parser's stack.
            raise ManifestError(f"unreadable manifest: {e!r}"[:500], path=path) from e
        return text

    @classmethod
    def _body(cls, data: bytes, path: str) -> dict[str, Any]:
        """The manifest's body, its checksum, format and version checked."""
        text = cls._text(data, path)
        try:
            body = _dict(json.loads(text), "manifest body")
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise ManifestError(f"unreadable manifest: {e!r}"[:500], path=path) from e
        if body.get("format") != FORMAT:
            raise ManifestError(f"not an mtc manifest (format={body.get('format')!r})", path=path)
        if body.get("version") not in READS:
            raise ManifestError(
                f"manifest version {body.get('version')} is not supported "
                f"(this mtc reads versions {', '.join(map(str, READS))}: a newer mtc wrote "
                f"it; upgrade this reader)",
                path=path)
        return body


class Summary(NamedTuple):
    """What a replicator reads of a manifest: hosts that saved the step, its run,
    their replicator ranks (empty: host h is rank h) and whose manifest it is."""

    num_hosts: int
    run: str
    ranks: tuple[int, ...] = ()
    host: int = 0  # the saving host whose manifest it is
    step: int = -1  # the step it describes
    nbytes: int = 0  # its files' bytes: the shards' it names, and its own


STEP_MAX = 2**62  # a step number: an int64 everywhere, with room to spare


def check_ranks(ranks: Any, num_hosts: int) -> tuple[int, ...]:
    """The saving hosts' replicator ranks: one distinct rank >= 0 per host."""
    got = tuple(_int(r, "rank", 0, 2**31 - 1) for r in _list(ranks, "ranks"))
    if len(got) != num_hosts or len(set(got)) != len(got):
        raise ValueError(f"ranks {list(got)[:16]} are not {num_hosts} distinct ranks")
    return got


def _ranks(body: dict[str, Any]) -> tuple[int, ...]:
    if "ranks" not in body:
        return ()
    return check_ranks(body["ranks"], _int(body["num_hosts"], "num_hosts", 1))


def check_run(run: object) -> str:
    """A run identity from a manifest or a message: a short plain string."""
    if not isinstance(run, str) or len(run) > RUN_MAX or not set(run) <= RUN_CHARS:
        raise ValueError(f"bad run identity {str(run)[:80]!r}")
    return run


KINDS = ("array", "numpy", "prng_key", "value")


def _dict(x: Any, what: str) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise ValueError(f"{what} is not an object")
    return x


def _list(x: Any, what: str) -> list[Any]:
    if not isinstance(x, list):
        raise ValueError(f"{what} is not a list")
    return x


def _int(x: Any, what: str, lo: int | None = None, hi: int | None = None) -> int:
    """An integer field (JSON has no other kind; a bool or a float is refused)."""
    if not isinstance(x, int) or isinstance(x, bool):
        raise ValueError(f"{what} {x!r} is not an integer")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        raise ValueError(f"{what} {x} out of range")
    return x


def _pair(p: Any) -> tuple[int, int]:
    p = _list(p, "index pair")
    if len(p) != 2:
        raise ValueError(f"index pair {p!r}")
    return _int(p[0], "index", 0), _int(p[1], "index", 0)
