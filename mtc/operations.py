"""Every host operation, defined once: its name, its typed request, its typed reply,
and which part of a host's side answers it.

The three dispatchers (:mod:`mtc.dispatch`) carry these and nothing else; they
differ only in how a request reaches a host and how the bytes move:

============  ==============================  ==================================
dispatcher    a request                       array bytes
============  ==============================  ==================================
local         a call in this process          by reference
process       a gRPC call to the host's       the host's shared-memory area
              sidecar process                 (save slots, reply files)
colocated     a colocated-Python call to      the call's inputs and outputs,
              every worker at once            on the workers' CPU devices
============  ==============================  ==================================

The operations on a host's root (``Side.ROOT``) travel as one request and one
reply of bytes on every dispatcher (:func:`mtc.contract.encode_request`). A
save's and a restore's (``Side.SAVES``, ``Side.LOADS``) carry arrays: the local
dispatcher calls the host side directly, the process dispatcher sends the
request with the bytes in the host's area, the colocated dispatcher calls the
worker's method of the same name. ``Side.SIDECAR`` operations exist only where a host is a process
of its own. A manager's close closes the host side in this process or a
colocated worker's objects (``close``); a sidecar process outlives its
controller. A colocated worker that failed keeps its typed error for the
request :data:`mtc.contract.ERROR_REQUEST`. Nothing here imports JAX: the
sidecar process never does.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from mtc import validate
from mtc.contract import ReadTask, encode_request, task_to_json
from mtc.errors import ProtocolError


class Side(enum.Enum):
    """The part of a host's side that answers an operation."""

    ROOT = "mtc.sidecar.ops.HostOps"  # lists, reads, deletes under the RAM disk
    SAVES = "mtc.sidecar.save.agent.HostAgent"  # stages and writes saves
    LOADS = "mtc.sidecar.restore.load.ShardLoader"  # reads a restore's regions, verified
    SIDECAR = "mtc.sidecar.host.service.HostService"  # the sidecar process itself


# -- typed requests ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Request:
    """A request's arguments; :meth:`args` is what crosses, as JSON, in field order."""

    def args(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class NoArgs(Request):
    pass


@dataclasses.dataclass(frozen=True)
class OpenRequest(Request):
    lock: bool
    clean: bool
    identify: bool = False
    metadata: str | None = None  # root metadata (JSON) to keep where none is (not sent: None)

    def args(self) -> dict[str, Any]:
        out = super().args()
        if self.metadata is None:
            del out["metadata"]
        return out


@dataclasses.dataclass(frozen=True)
class StepRequest(Request):
    step: int


@dataclasses.dataclass(frozen=True)
class SurveyRequest(Request):
    manifest: bool = True
    step: int | None = None  # None: each host's newest (not sent)

    def args(self) -> dict[str, Any]:
        out: dict[str, Any] = {"manifest": self.manifest}
        if self.step is not None:
            out["step"] = self.step
        return out


@dataclasses.dataclass(frozen=True)
class RetainRequest(Request):
    complete: list[int]
    max_to_keep: int | None
    keep_period: int | None
    before_write: bool


@dataclasses.dataclass(frozen=True)
class ReadRequest(Request):
    """Regions to read; by host (every worker at once, each reading its own)."""

    step: int
    tasks: Sequence[ReadTask] | Mapping[int, Sequence[ReadTask]]

    def args(self) -> dict[str, Any]:
        tasks = self.tasks
        return {"step": self.step, "tasks": (
            {str(h): [task_to_json(t) for t in ts] for h, ts in tasks.items()}
            if isinstance(tasks, Mapping) else [task_to_json(t) for t in tasks])}


@dataclasses.dataclass(frozen=True)
class StageRequest(Request):
    """A save's shards in a slot of the host's area (the process dispatcher's
    stage): the header as JSON text, the slot's name and size, a row per shard
    (leaf, index, dtype, shape, offset)."""

    header: str
    slot: str
    size: int
    shards: list[list[Any]]
    slice: int
    num_hosts: int


# -- typed replies ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Opened:
    """A host's root as a manager's open found it, in the open's one round trip:
    the uncommitted folders it removed, the step folders that are not mtc's (no
    manifest: Orbax's, another tool's; left alone) and, where asked, the root's
    identity (the token its replicator reports back when it serves that folder),
    and the size of its newest step's manifest (0: none), which a restore's first
    call asks for."""

    removed: tuple[str, ...] = ()
    foreign: tuple[int, ...] = ()
    identity: str = ""
    manifest_bytes: int = 0
    metadata: str = ""  # the root metadata kept there (JSON; "": none)


@dataclasses.dataclass(frozen=True)
class Surveyed:
    """One host's part of a survey: its committed steps, (hosts that saved it, run)
    of each, the manifest that came (its step and text; None: none), its space
    (free, newest step's bytes; None: not asked), its newest manifest's size."""

    steps: list[int]
    facts: dict[int, tuple[int, str]]
    manifest: tuple[int, str] | None
    space: tuple[int, int] | None
    manifest_bytes: int


@dataclasses.dataclass(frozen=True)
class Hello:
    """A sidecar's answer to a controller's first request: who it is, the rank it
    took, its area, whether it runs colocated Python and how many programs it keeps."""

    host: int
    rank: int
    area: str
    colocated: bool
    programs: int


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A load's regions, end to end in a reply file of the host's area."""

    file: str
    size: int
    offsets: list[int]


T = TypeVar("T")
Q = TypeVar("Q", bound=Request)
R = TypeVar("R")


def per_host(value: Callable[[Any], T]) -> Callable[[Any], dict[int, T]]:
    """A reply keyed by host (a JSON object's keys are strings; null: none asked)."""
    def decode(reply: Any) -> dict[int, T]:
        return {int(h): value(v) for h, v in (reply or {}).items()}
    return decode


def _steps(v: Any) -> list[int]:
    return [int(s) for s in v]


def _space(v: Any) -> tuple[int, int]:
    return int(v[0]), int(v[1])


def _opened(v: Any) -> Opened:
    return Opened(tuple(str(n) for n in v["removed"]), tuple(int(s) for s in v["foreign"]),
                  str(v["identity"]), int(v.get("manifest_bytes", 0)),
                  str(v.get("metadata", "")))


def _surveyed(v: Any) -> Surveyed:
    return Surveyed(_steps(v["steps"]),
                    {int(s): (int(n), str(run)) for s, (n, run) in v["facts"].items()},
                    None if v.get("manifest") is None else (int(v["step"]), str(v["manifest"])),
                    None if v.get("space") is None else _space(v["space"]),
                    int(v.get("manifest_bytes") or 0))


def _hello(v: Any) -> Hello:
    rank = v.get("rank")
    if not validate.is_int(rank):  # never coerced: the rank it took, as it says it
        raise ProtocolError(f"a sidecar's hello names no rank ({rank!r})"[:120])
    return Hello(int(v["host"]), rank, str(v["area"]), v.get("colocated") is True,
                 int(v.get("programs", 0)))


def _loaded(v: Any) -> Loaded:
    return Loaded(str(v["file"]), int(v["size"]), [int(o) for o in v["offsets"]])


def _written(v: Any) -> list[str]:
    """The save slots whose saves were written since the last poll or wait."""
    return [str(n) for n in v]


def _none(_v: Any) -> None:
    return None


def _same(v: Any) -> Any:
    return v


# -- the table ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Operation(Generic[Q, R]):
    """A host operation: ``reply`` types one host process's decoded reply."""

    name: str
    side: Side
    request: type[Q]
    reply: Callable[[Any], R]

    def encode(self, hosts: Sequence[int], request: Q) -> bytes:
        """The request's bytes (:func:`mtc.contract.encode_request`)."""
        if not isinstance(request, self.request):
            raise TypeError(f"{self.name} takes a {self.request.__name__}")
        return encode_request(self.name, hosts, **request.args())


# On a host's root, every dispatcher alike (HostOps answers them).
OPEN = Operation("open", Side.ROOT, OpenRequest, per_host(_opened))
RELEASE = Operation("release", Side.ROOT, NoArgs, _none)
STEPS = Operation("steps", Side.ROOT, NoArgs, per_host(_steps))
SURVEY = Operation("survey", Side.ROOT, SurveyRequest, per_host(_surveyed))
MANIFEST = Operation("manifest", Side.ROOT, StepRequest, bytes)
READ = Operation("read", Side.ROOT, ReadRequest, _same)  # the regions' bytes, end to end
DELETE = Operation("delete", Side.ROOT, StepRequest, bool)
RETAIN = Operation("retain", Side.ROOT, RetainRequest, per_host(_space))
SPACE = Operation("space", Side.ROOT, NoArgs, per_host(_space))
SETTLE = Operation("settle", Side.ROOT, NoArgs, _none)
# A save's and a restore's. The process dispatcher sends these requests; the
# colocated one calls the worker's method of the same name (mtc.sidecar.colocated),
# the local one the host side itself.
STAGE = Operation("stage", Side.SAVES, StageRequest, bool)
POLL = Operation("poll", Side.SAVES, NoArgs, _written)
WAIT = Operation("wait", Side.SAVES, NoArgs, _written)
LOAD = Operation("load", Side.LOADS, ReadRequest, _loaded)
# A host that is a process of its own: where its area is, and (the local cluster's
# fault injector) what its RAM disk holds.
HELLO = Operation("hello", Side.SIDECAR, NoArgs, _hello)
INSPECT = Operation("inspect", Side.SIDECAR, NoArgs, _same)

OPERATIONS: tuple[Operation[Any, Any], ...] = (
    OPEN, RELEASE, STEPS, SURVEY, MANIFEST, READ, DELETE, RETAIN, SPACE, SETTLE,
    STAGE, POLL, WAIT, LOAD, HELLO, INSPECT)


def names(sides: Iterable[Side]) -> tuple[str, ...]:
    """The operations of ``sides``, by name, in the table's order."""
    wanted = set(sides)
    return tuple(op.name for op in OPERATIONS if op.side in wanted)
