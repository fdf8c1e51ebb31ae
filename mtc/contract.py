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
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtc import errors, layout, validate
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
        """The header a host received, checked: the step names a folder."""
        d = json.loads(data)
        if not isinstance(d, dict):
            raise ProtocolError("a save header is a JSON object")
        leaves = d["leaves"]
        array_leaves = d["array_leaves"]
        if not isinstance(leaves, list) or not isinstance(array_leaves, list) or not all(
                validate.is_int(i) and 0 <= i < len(leaves) for i in array_leaves):
            raise ProtocolError("malformed save header: leaves or array_leaves")
        if not isinstance(d["skip_if_busy"], bool):
            raise ProtocolError("malformed save header: skip_if_busy")
        ranks = d.get("ranks", [])
        if not isinstance(ranks, list) or not all(validate.is_int(r) and r >= 0 for r in ranks):
            raise ProtocolError("malformed save header: ranks")
        return cls(validate.step(d["step"]), tuple(LeafEntry.from_json(x) for x in leaves),
                   tuple(array_leaves), d["skip_if_busy"], check_run(d.get("run", "")),
                   tuple(ranks))


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
    """A read task from a request: integers are integers, the region is a region."""
    if not isinstance(d, dict):
        raise ProtocolError("a read task is a JSON object")
    index = tuple((_nonneg(a), _nonneg(b)) for a, b in d["index"])
    if any(a > b for a, b in index):
        raise ProtocolError(f"read task region {list(index)} is not a region")
    return ReadTask(_nonneg(d["leaf"]), index, str(d["dtype"]),
                    tuple(_nonneg(x) for x in d["devices"]),
                    tuple(Piece(_nonneg(p["host"]), ShardEntry.from_json(p["entry"]))
                          for p in d["pieces"]))


def _nonneg(x: Any) -> int:
    if not validate.is_int(x) or x < 0:
        raise ProtocolError(f"expected a non-negative integer, got {x!r}"[:120])
    return int(x)


# -- host operations on the wire ---------------------------------------------------------
#
# A host request (the operations are mtc.operations') is one request and one reply
# of bytes, whichever way they travel (a direct call, a colocated-Python call, a
# sidecar process). A request is JSON {"op", "hosts", "args"}; a reply is a kind
# byte and a payload: b"J" JSON, b"B" raw bytes (a region read), b"E" a typed error.
# Colocated calls answer with one uint8 per worker; a worker whose call raised
# answers FAILED and keeps its typed error for the request ERROR_REQUEST.
FAILED = 255
ERROR_REQUEST = b'{"op": "error"}'
# A payload in a buffer of fixed size (a colocated call's answer, a worker's part
# of a load request): its length, then as much of it as fits, zeros after.
_LENGTH = struct.Struct("<Q")


def frame(payload: bytes | bytearray | memoryview, size: int) -> bytearray:
    """``size`` bytes: ``payload``'s length (8 bytes, little-endian), then as much of
    it as fits, zero-padded. A reader learns the whole length even where the
    payload was cut (and fetches the rest another way)."""
    buf = bytearray(size)
    _LENGTH.pack_into(buf, 0, len(payload))
    head = memoryview(payload)[:max(0, size - _LENGTH.size)]
    buf[_LENGTH.size:_LENGTH.size + len(head)] = head
    return buf


def unframe(buf: Any) -> tuple[int, bytes | None]:
    """The length a framed buffer states and its payload; None where the stated
    length is more than the buffer holds."""
    view = memoryview(buf).cast("B")
    if len(view) < _LENGTH.size:
        raise ProtocolError(f"a framed buffer of {len(view)} bytes has no length")
    (n,) = _LENGTH.unpack_from(view)
    if n > len(view) - _LENGTH.size:
        return n, None
    return n, bytes(view[_LENGTH.size:_LENGTH.size + n])


def encode_request(op: str, hosts: Sequence[int], **args: Any) -> bytes:
    return json.dumps({"op": op, "hosts": list(hosts), "args": args}).encode()


def decode_request(data: bytes) -> tuple[str, list[int], dict[str, Any]]:
    """A request's operation, hosts and arguments, checked before anything runs: every
    host a non-negative integer, every step (``step``, ``complete``) an integer in
    range (a string would name a folder anywhere). Whether the operation is one
    the receiver serves is the receiver's check."""
    try:
        d = json.loads(data)
        op, hosts, args = d["op"], list(d["hosts"]), dict(d["args"])
    except (ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"malformed host request: {e}") from e
    if not isinstance(op, str):
        raise ProtocolError("a host request's op is a name")
    hosts = [_nonneg(h) for h in hosts]
    if "step" in args:
        args["step"] = validate.step(args["step"])
    if "complete" in args:
        if not isinstance(args["complete"], list):
            raise ProtocolError("complete is a list of steps")
        args["complete"] = [validate.step(s, what="complete step") for s in args["complete"]]
    for name in ("max_to_keep", "keep_period"):
        if args.get(name) is not None:
            _nonneg(args[name])
    for name in ("lock", "clean", "create", "before_write"):
        if name in args and not isinstance(args[name], bool):
            raise ProtocolError(f"{name} is true or false")
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


def error_fields(e: MtcError) -> dict[str, Any]:
    """A typed error as it crosses: its class's name, message, step, host and file."""
    return {"type": type(e).__name__, "message": e.message, "step": e.step, "host": e.host,
            "path": e.path}


def error_from(d: dict[str, Any], *, default: type[MtcError] = MtcError,
               host: int | None = None) -> MtcError:
    """The typed error :func:`error_fields` described, as itself (``default``: for a
    class mtc does not have; ``host``: for an error that names none)."""
    cls = getattr(errors, str(d.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, MtcError)):
        cls = default
    return cls(str(d.get("message")), step=d.get("step"),
               host=host if d.get("host") is None else d["host"], path=d.get("path"))


def typed_error(e: Exception, *, storage: str, request: str = "host",
                host: int | None = None) -> MtcError:
    """What a host side answers for ``e``, raised while it served a request: mtc's
    own error as itself; a failed system call as a StorageError naming its file
    (``storage``: who failed); anything else, a request's wrong arguments, as a
    ProtocolError naming the ``request``. ``host``: the answering host's rank."""
    if isinstance(e, MtcError):
        return e
    if isinstance(e, OSError):
        return errors.StorageError(f"{storage}: {e.strerror or e}", host=host, path=e.filename)
    return ProtocolError(f"malformed {request} request: {e!r}", host=host)


def encode_error(e: MtcError) -> bytes:
    return b"E" + json.dumps(error_fields(e)).encode()


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
        raise error_from(json.loads(payload))
    raise ProtocolError(f"malformed host reply (kind {kind!r})")
