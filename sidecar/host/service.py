"""The sidecar process's service: every host operation, for the one host it runs on.

It plays the part of the colocated-Python sidecar of a Pathways worker on the
local cluster: the trainer reaches it only over gRPC, and array bytes cross only
through the host's shared-memory area (:mod:`mtc.transfer`), never through the
RAM disk, which only this process (and the host's replicator) can see.

Requests are the seam's JSON requests (``mtc.contract``); besides the RAM-disk
operations of :class:`mtc.sidecar.ops.HostOps` it serves ``stage`` (shards placed
in a save slot), ``poll`` and ``wait`` (background errors; slots written since)
and ``load`` (regions read into a fresh reply file). One gRPC method carries them
all, with raw bytes in and out. A second, ``Execute``, runs the programs of the
controller's colocated-Python calls (:mod:`.colocated`), when the sidecar was
started with ``--colocated-devices``.

A request names the host's rank in the job that sends it (its ``hosts``: exactly
one): a job on fewer slices numbers its hosts from 0, as it would on a resized
Pathways mesh, so the rank is the request's, not the process's. ``--host`` is the
process's identity, named in its errors and logs. ``inspect`` answers the local
cluster's fault injector (what is committed, being written, held for peers) so
that it too reaches the RAM disk only through this process.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from mtc import layout, operations, transfer, validate
from mtc.contract import (
    AgentConfig,
    SaveHeader,
    encode_error,
    encode_reply,
    task_from_json,
    typed_error,
)
from mtc.errors import MtcError, ProtocolError
from mtc.operations import Side
from mtc.sidecar.dtypes import numpy_dtype
from mtc.sidecar.host.colocated import ColocatedServer
from mtc.sidecar.ops import HostOps
from mtc.sidecar.replicator.store.store import REPLICA_DIR
from mtc.sidecar.restore.load import ShardLoader, check_tasks
from mtc.sidecar.save.agent import HostAgent
from mtc.sidecar.storage import spare
from mtc.sidecar.storage.names import tmp_step

log = logging.getLogger(__name__)
SERVICE = "mtc.Host"
METHOD = f"/{SERVICE}/Call"
MAX_MESSAGE = 256 << 20  # a request's or reply's bytes (a read's regions travel in replies)
# Room a load leaves free in the shared-memory area: its reply file must not fill
# the area the trainer copies its saves into.
AREA_RESERVE = 64 << 20
_SLOT = re.compile(r"save-[0-9]{1,4}")
REPLY_TTL_S = 120.0


class HostService:
    """Serves one host. ``_written`` (slots whose save ended) is guarded by ``_lock``;
    the agent has its own. ``host`` is the process's identity; ranks come with requests."""

    def __init__(self, config: AgentConfig, host: int, area: Path,
                 colocated: ColocatedServer | None = None) -> None:
        self.config = config
        self.colocated = colocated
        self.host = host
        self.area = area
        self.agent = HostAgent(config)
        self.ops = HostOps(config, max_reply_bytes=MAX_MESSAGE - 4096)
        self._written: list[str] = []
        self._lock = threading.Lock()
        # A save's and a restore's operations and the process's own (mtc.operations),
        # by their methods here; the rest are HostOps'.
        self._ops: dict[str, Callable[[int, dict[str, Any]], Any]] = {
            name: getattr(self, f"_{name}")
            for name in operations.names([Side.SAVES, Side.LOADS, Side.SIDECAR])}

    def handle(self, request: bytes) -> bytes | bytearray:
        """One request's reply (a typed error encoded in it); :class:`Undecodable`
        when the request is not JSON at all."""
        try:
            d = json.loads(request)
        except (ValueError, RecursionError) as e:  # RecursionError: '[' 100,000 deep
            raise Undecodable(f"malformed request: not JSON ({type(e).__name__})") from None
        op = d.get("op") if isinstance(d, dict) else None
        try:
            ranks = d.get("hosts") if isinstance(d, dict) else None
            if not (isinstance(ranks, list) and len(ranks) == 1 and isinstance(ranks[0], int)
                    and not isinstance(ranks[0], bool) and ranks[0] >= 0):
                raise ProtocolError(f"a request names the one rank it asks (got {ranks!r})",
                                    host=self.host)
            if op not in self._ops:
                return self.ops.handle(request)
            args = d.get("args")
            if not isinstance(args, dict):
                raise ProtocolError(f"malformed {op} request: no arguments", host=self.host)
            return encode_reply(self._ops[op](ranks[0], args))
        except (MtcError, OSError, TypeError, KeyError, ValueError, IndexError) as e:
            return encode_error(typed_error(e, storage="sidecar", request=str(op),
                                            host=self.host))

    def _hello(self, rank: int, args: dict[str, Any]) -> dict[str, Any]:
        return {"host": self.host, "rank": rank, "area": str(self.area),
                "colocated": self.colocated is not None,
                "programs": self.colocated.programs if self.colocated is not None else 0}

    def _inspect(self, rank: int, args: dict[str, Any]) -> dict[str, Any]:
        """What this host's RAM disk holds: committed steps, steps being written,
        and per origin rank the peer copies committed here."""
        root = self.config.root(rank)
        names = [p.name for p in root.iterdir()] if root.is_dir() else []
        writing = sorted({s for s in map(tmp_step, names) if s is not None})
        replicas: dict[str, list[int]] = {}
        held = root / REPLICA_DIR
        for origin in sorted(held.iterdir()) if held.is_dir() else []:
            if origin.name.isdigit() and origin.is_dir():
                replicas[origin.name] = sorted(
                    s for s in layout.committed_steps(origin)
                    if (origin / f"{s}.files.json").is_file())
        return {"host": self.host, "committed": layout.committed_steps(root),
                "writing": writing, "replicas": replicas}

    def _stage(self, rank: int, args: dict[str, Any]) -> bool:
        header = SaveHeader.from_bytes(args["header"].encode())
        slot = args["slot"]
        if not isinstance(slot, str) or not _SLOT.fullmatch(slot):
            raise ProtocolError(f"bad slot name {slot!r}"[:120], host=self.host)
        size = validate.count(args["size"], "slot size", validate.MAX_FILE_BYTES)
        view = transfer.map_file(self.area / slot, size, writable=False)
        shards = []
        for leaf, index, dtype, shape, offset in args["shards"]:
            dt = numpy_dtype(dtype)
            dims = [validate.count(d, "shape", view.size) for d in shape]
            n = math.prod(dims) * dt.itemsize
            if not validate.is_int(offset) or offset < 0 or offset + n > view.size:
                raise ProtocolError(f"shard outside slot {slot}", step=header.step,
                                    host=self.host)
            data = view[offset:offset + n].view(dt).reshape(dims)
            shards.append((validate.count(leaf, "leaf", len(header.leaves) - 1),
                           tuple((validate.count(a, "index", validate.MAX_FILE_BYTES),
                                  validate.count(b, "index", validate.MAX_FILE_BYTES))
                                 for a, b in index), data))

        def written(_error: BaseException | None) -> None:  # errors come by poll/wait
            with self._lock:
                self._written.append(slot)

        num_hosts = validate.count(args["num_hosts"], "num_hosts", 1 << 20, lo=1)
        self.agent.stage_views(header, rank, shards, written,
                               slice_=validate.count(args["slice"], "slice", num_hosts),
                               num_hosts=num_hosts)
        return True

    def _written_since(self) -> list[str]:
        with self._lock:
            out, self._written = self._written, []
        return out

    def _poll(self, rank: int, args: dict[str, Any]) -> list[str]:
        self.agent.raise_background_error()
        return self._written_since()

    def _wait(self, rank: int, args: dict[str, Any]) -> list[str]:
        try:
            self.agent.wait()
        finally:
            written = self._written_since()
        return written

    def _load(self, rank: int, args: dict[str, Any]) -> dict[str, Any]:
        """Read each task's region (pieces this host holds, verified) into one reply file.
        The request is checked whole first (:func:`check_tasks`), and the reply must
        fit in the area; a reply file is never left behind by a load that failed."""
        step = validate.step(args["step"], host=self.host)
        if not isinstance(args["tasks"], list):
            raise ProtocolError("tasks is a list", step=step, host=self.host)
        tasks = [task_from_json(t) for t in args["tasks"]]
        for t in tasks:
            if any(p.host != rank for p in t.pieces):
                raise ProtocolError("asked to read another host's pieces", step=step,
                                    host=self.host)
        asked = check_tasks(tasks, step=step, host=self.host)
        room = spare.room(self.area, AREA_RESERVE)
        if asked > room:
            raise ProtocolError(f"a load of {asked} bytes does not fit in the shared-memory "
                                f"area ({max(room, 0)} bytes free beyond the reserve)",
                                step=step, host=self.host, path=str(self.area))
        self._remove_stale_replies()
        loader = ShardLoader(step, self.config.root)  # closed with the reply file
        itemsizes = [numpy_dtype(t.dtype).itemsize for t in tasks]
        offsets, total = transfer.layout_regions(
            [math.prod(t.shape) * k for t, k in zip(tasks, itemsizes, strict=True)])
        path = transfer.new_reply_file(self.area)
        # write(2) into fresh tmpfs pages is about twice as fast here as storing
        # through a new mapping (the kernel allocates and copies in one pass). One
        # region at a time: this process holds at most one assembled region.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, total)
            for t, off in zip(tasks, offsets, strict=True):
                view = np.ascontiguousarray(loader.read(t)).reshape(-1).view(np.uint8).data
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], off + done)
                del view
        except BaseException:
            os.unlink(path)  # nobody will be told its name
            raise
        finally:
            os.close(fd)
            loader.close()
        return {"file": path.name, "size": total, "offsets": offsets}

    def _remove_stale_replies(self) -> None:
        """Reply files nobody took within REPLY_TTL_S (the trainer maps and unlinks
        its own at once): a caller that never does must not fill the area."""
        now = time.time()
        for name in os.listdir(self.area):
            if name.startswith("reply-"):
                try:
                    if now - os.lstat(self.area / name).st_mtime > REPLY_TTL_S:
                        os.unlink(self.area / name)
                except FileNotFoundError:
                    pass

    def execute(self, message: bytes) -> bytes:
        """A colocated-Python call (the ``Execute`` method): see :mod:`.colocated`."""
        if self.colocated is None:
            return ColocatedServer.refuse(self.host, self.area)
        return self.colocated.execute(message)

    def close(self) -> None:
        self.agent.close()
        self.ops.close()  # the deletions under way finish, their thread joined
        if self.colocated is not None:
            self.colocated.close()


class Undecodable(ValueError):
    """A request that is not JSON: answered INVALID_ARGUMENT (it was UNKNOWN, a
    recursion error escaping the handler)."""


def handler(service: HostService) -> grpc.GenericRpcHandler:
    def call(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return bytes(service.handle(request))  # gRPC sends bytes only
        except Undecodable as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise AssertionError("unreachable") from e

    def execute(request: bytes, context: grpc.ServicerContext) -> bytes:
        return service.execute(request)

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Call": grpc.unary_unary_rpc_method_handler(call, request_deserializer=None,
                                                    response_serializer=None),
        "Execute": grpc.unary_unary_rpc_method_handler(execute, request_deserializer=None,
                                                       response_serializer=None)})
