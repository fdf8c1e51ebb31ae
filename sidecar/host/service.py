"""The sidecar process's service: every host operation, for the one host it runs on.

It plays the part of the colocated-Python sidecar of a Pathways worker on the
local cluster: the trainer reaches it only over gRPC, and array bytes cross only
through the host's shared-memory area (:mod:`mtc.transfer`), never through the
RAM disk, which only this process (and the host's replicator) can see.

Requests are the seam's JSON requests (``mtc.contract``); besides the RAM-disk
operations of :class:`mtc_sidecar.ops.HostOps` it serves ``stage`` (shards placed
in a save slot), ``poll`` and ``wait`` (background errors; slots written since)
and ``load`` (regions read into a fresh reply file). One gRPC method carries them
all, with raw bytes in and out.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from mtc import transfer
from mtc.contract import (
    AgentConfig,
    SaveHeader,
    encode_error,
    encode_reply,
    task_from_json,
)
from mtc.errors import MtcError, ProtocolError, StorageError
from mtc_sidecar.agent import HostAgent
from mtc_sidecar.load import ShardLoader
from mtc_sidecar.ops import HostOps

log = logging.getLogger(__name__)
SERVICE = "mtc.Host"
METHOD = f"/{SERVICE}/Call"
TRANSFER_OPS = ("hello", "stage", "poll", "wait", "load")


class HostService:
    """Serves one host. ``_written`` (slots whose save ended) is guarded by ``_lock``;
    the agent has its own."""

    def __init__(self, config: AgentConfig, host: int, area: Path) -> None:
        self.config = config
        self.host = host
        self.area = area
        self.agent = HostAgent(config)
        self.ops = HostOps(config)
        self._written: list[str] = []
        self._lock = threading.Lock()
        self._ops: dict[str, Callable[[dict[str, Any]], Any]] = {
            "hello": self._hello, "stage": self._stage, "poll": self._poll,
            "wait": self._wait, "load": self._load}

    def handle(self, request: bytes) -> bytes | bytearray:
        try:
            d = json.loads(request)
            op = d.get("op") if isinstance(d, dict) else None
        except ValueError:
            op = None
        if op not in TRANSFER_OPS:
            return self.ops.handle(request, serves=[self.host])
        try:
            args = d.get("args")
            if not isinstance(args, dict):
                raise ProtocolError(f"malformed {op} request: no arguments", host=self.host)
            return encode_reply(self._ops[op](args))
        except MtcError as e:
            return encode_error(e)
        except OSError as e:
            return encode_error(StorageError(f"sidecar: {e.strerror or e}", host=self.host,
                                             path=e.filename))
        except (TypeError, KeyError, ValueError, IndexError) as e:
            return encode_error(ProtocolError(f"malformed {op} request: {e!r}", host=self.host))

    def _hello(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"host": self.host, "area": str(self.area)}

    def _stage(self, args: dict[str, Any]) -> bool:
        header = SaveHeader.from_bytes(args["header"].encode())
        slot = args["slot"]
        if "/" in slot or slot.startswith("."):
            raise ProtocolError(f"bad slot name {slot!r}", host=self.host)
        view = transfer.map_file(self.area / slot, int(args["size"]), writable=False)
        shards = []
        for leaf, index, dtype, shape, offset in args["shards"]:
            n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if offset < 0 or offset + n > view.size:
                raise ProtocolError(f"shard outside slot {slot}", step=header.step,
                                    host=self.host)
            data = view[offset:offset + n].view(np.dtype(dtype)).reshape(shape)
            shards.append((int(leaf), tuple((int(a), int(b)) for a, b in index), data))

        def written(_error: BaseException | None) -> None:  # errors come by poll/wait
            with self._lock:
                self._written.append(slot)

        self.agent.stage_views(header, self.host, shards, written)
        return True

    def _written_since(self) -> list[str]:
        with self._lock:
            out, self._written = self._written, []
        return out

    def _poll(self, args: dict[str, Any]) -> list[str]:
        self.agent.raise_background_error()
        return self._written_since()

    def _wait(self, args: dict[str, Any]) -> list[str]:
        try:
            self.agent.wait()
        finally:
            written = self._written_since()
        return written

    def _load(self, args: dict[str, Any]) -> dict[str, Any]:
        """Read each task's region (pieces this host holds, verified) into one reply file."""
        step = int(args["step"])
        tasks = [task_from_json(t) for t in args["tasks"]]
        for t in tasks:
            if any(p.host != self.host for p in t.pieces):
                raise ProtocolError("asked to read another host's pieces", step=step,
                                    host=self.host)
        loader = ShardLoader(step, self.config.root)
        regions = [loader.read(t) for t in tasks]
        offsets, total = transfer.layout_regions([r.nbytes for r in regions])
        path = transfer.new_reply_file(self.area)
        # write(2) into fresh tmpfs pages is about twice as fast here as storing
        # through a new mapping (the kernel allocates and copies in one pass).
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, total)
            for r, off in zip(regions, offsets, strict=True):
                view = np.ascontiguousarray(r).reshape(-1).view(np.uint8).data
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], off + done)
        finally:
            os.close(fd)
        return {"file": path.name, "size": total, "offsets": offsets}

    def close(self) -> None:
        self.agent.close()


def handler(service: HostService) -> grpc.GenericRpcHandler:
    def call(request: bytes, context: grpc.ServicerContext) -> bytes:
        return bytes(service.handle(request))  # gRPC sends bytes only

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Call": grpc.unary_unary_rpc_method_handler(call, request_deserializer=None,
                                                    response_serializer=None)})
