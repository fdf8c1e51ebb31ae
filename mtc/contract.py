"""What crosses between the controller and a host's side: the one vocabulary both import.

The controller (``mtc/``) describes a save (:class:`SaveHeader`), the job
(:class:`AgentConfig`) and a restore's reads (:class:`ReadTask` of
:class:`Piece`, :class:`LeafSpec`); the host side (``sidecar/``) executes them.
Nothing here touches a RAM disk or imports JAX: every type is plain data that
can travel as JSON or inside a pickled colocated function.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtc import errors, layout
from mtc.errors import MtcError, ProtocolError
from mtc.manifest import Index, LeafEntry, ShardEntry, check_run


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """What an agent needs to know about the job; JSON so it can cross to a sidecar."""

    local_dir: str
    host_of_device: dict[int, int]
    slice_of_host: dict[int, int]
    subdirs: bool
    max_staged_bytes: int | None
    writer_threads: int

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> AgentConfig:
        d = json.loads(text)
        d["host_of_device"] = {int(k): v for k, v in d["host_of_device"].items()}
        d["slice_of_host"] = {int(k): v for k, v in d["slice_of_host"].items()}
        return cls(**d)

    def root(self, host: int) -> Path:
        return layout.host_root(self.local_dir, host, self.subdirs)


@dataclasses.dataclass(frozen=True)
class SaveHeader:
    """The controller's description of one save: the step and the tree's leaves.

    ``array_leaves[i]`` is the leaf number of the i-th array handed to ``stage``;
    ``run`` the saving manager's run identity, written into every host's manifest,
    as ``ranks`` (each host's replicator rank, when not host h = rank h) is.
    """

    step: int
    leaves: tuple[LeafEntry, ...]
    array_leaves: tuple[int, ...]
    skip_if_busy: bool
    run: str = ""
    ranks: tuple[int, ...] = ()

    def to_bytes(self) -> bytes:
        return json.dumps({"step": self.step, "leaves": [x.to_json() for x in self.leaves],
                           "array_leaves": list(self.array_leaves),
                           "skip_if_busy": self.skip_if_busy, "run": self.run,
                           "ranks": list(self.ranks)}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> SaveHeader:
        d = json.loads(data)
        return cls(d["step"], tuple(LeafEntry.from_json(x) for x in d["leaves"]),
                   tuple(d["array_leaves"]), d["skip_if_busy"], check_run(d.get("run", "")),
                   tuple(int(r) for r in d.get("ranks", ())))


def shard_index(index: tuple[slice, ...], shape: Sequence[int]) -> Index:
    """A shard's tuple of slices as explicit (start, stop) pairs."""
    out = []
    for sl, dim in zip(index, shape, strict=True):
        start, stop, _ = sl.indices(dim)
        out.append((start, stop))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Piece:
    """A saved shard (on ``host``) that overlaps a task's region."""

    host: int
    entry: ShardEntry


@dataclasses.dataclass(frozen=True)
class ReadTask:
    leaf: int
    index: Index
    dtype: str
    device_ids: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.index)


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """The global array a leaf's tasks assemble into."""

    shape: tuple[int, ...]
    dtype: str
    sharding: Any  # a jax.sharding.Sharding on the devices that load it


def task_to_json(task: ReadTask) -> dict[str, Any]:
    return {"leaf": task.leaf, "index": [list(p) for p in task.index], "dtype": task.dtype,
            "devices": list(task.device_ids),
            "pieces": [{"host": p.host, "entry": p.entry.to_json()} for p in task.pieces]}


def task_from_json(d: dict[str, Any]) -> ReadTask:
    return ReadTask(int(d["leaf"]), tuple((int(a), int(b)) for a, b in d["index"]),
                    str(d["dtype"]), tuple(int(x) for x in d["devices"]),
                    tuple(Piece(int(p["host"]), ShardEntry.from_json(p["entry"]))
                          for p in d["pieces"]))


# -- host operations on the wire ---------------------------------------------------------
#
# Every host operation other than stage/wait/load is one request and one reply of
# bytes, whichever way they travel (a direct call, a colocated-Python call, a
# sidecar process). A request is JSON {"op", "hosts", "args"}; a reply is a kind
# byte and a payload: b"J" JSON, b"B" raw bytes (a region read), b"E" a typed error.

HOST_OPS = ("open", "release", "steps", "manifest", "delete", "retain", "space", "settle",
            "identify",
            "read")
# Colocated calls answer with one uint8 per worker; a worker whose call raised
# answers FAILED and keeps its typed error for the request ERROR_REQUEST.
FAILED = 255
ERROR_REQUEST = b'{"op": "error"}'


def encode_request(op: str, hosts: Sequence[int], **args: Any) -> bytes:
    return json.dumps({"op": op, "hosts": list(hosts), "args": args}).encode()


def decode_request(data: bytes) -> tuple[str, list[int], dict[str, Any]]:
    try:
        d = json.loads(data)
        op, hosts, args = d["op"], [int(h) for h in d["hosts"]], dict(d["args"])
    except (ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"malformed host request: {e}") from e
    if op not in HOST_OPS:
        raise ProtocolError(f"unknown host operation {op!r}")
    return op, hosts, args


@dataclasses.dataclass(frozen=True)
class Raw:
    """A raw reply in parts (a region's pieces): joined once, behind the kind byte."""

    parts: Sequence[Any]  # bytes-like


def encode_reply(value: Any) -> bytes | bytearray:
    if isinstance(value, Raw):
        out = bytearray(b"B")
        for part in value.parts:
            out += part
        return out
    if isinstance(value, (bytes, bytearray, memoryview)):
        return encode_reply(Raw([value]))
    return b"J" + json.dumps(value).encode()


def encode_error(e: MtcError) -> bytes:
    return b"E" + json.dumps({"type": type(e).__name__, "message": e.message,
                              "step": e.step, "host": e.host, "path": e.path}).encode()


def decode_reply(data: bytes | bytearray | memoryview) -> Any:
    """The reply's value (raw bytes as a view, writable when ``data`` is); a typed error
    from the host side is raised here, as itself."""
    kind = bytes(data[:1])
    if kind == b"B":
        return memoryview(data)[1:]
    payload = bytes(data[1:])  # JSON and errors are small; raw bytes are not copied
    if kind == b"J":
        return json.loads(payload)
    if kind == b"E":
        d = json.loads(payload)
        cls = getattr(errors, d["type"], None)
        if not (isinstance(cls, type) and issubclass(cls, MtcError)):
            cls = MtcError
        raise cls(d["message"], step=d["step"], host=d["host"], path=d["path"])
    raise ProtocolError(f"malformed host reply (kind {kind!r})")
