"""The host agent behind ``jax.experimental.colocated_python``.

On Pathways the controller's calls run in the colocated-Python sidecar of every
worker, each seeing only its own shards; on CPU devices JAX runs them in the
calling process. Colocated calls take and return only ``jax.Array`` pytrees on
the workers' colocated CPU devices: the save header and host requests travel as
replicated ``uint8`` arrays, answers (a restore's region bytes among them) come
back one per worker in its own shard. No controller device id, sharding or mesh
is ever inside a call.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import colocated_python

from mtc.contract import (
    ERROR_REQUEST,
    FAILED,
    AgentConfig,
    SaveHeader,
    decode_reply,
    encode_error,
    encode_reply,
    frame,
    typed_error,
)
from mtc.errors import MtcError
from mtc.operations import STEPS, SURVEY
from mtc.shards import device_order, place
from mtc.sidecar.ops import HostOps
from mtc.sidecar.restore.colocated_load import load_regions
from mtc.sidecar.save.agent import HostAgent
from mtc.sidecar.save.write import clear_frames

log = logging.getLogger(__name__)

# Where this host's RAM disk is, when the process that runs these objects knows
# better than the controller's config: the local cluster's sidecars
# (mtc.sidecar.host.colocated) keep each host's at a path of its own. On a real
# worker every host mounts its RAM disk at the job's ``local_dir``: None.
HOST_ROOT: Path | None = None

# The size of a small answer per worker: a host request's reply comes back whole in
# the call that asks it when it fits (the hosts' steps, a retention's space);
# only a longer one takes a second call. A restore's first call, which brings the
# manifests, asks for an answer sized by them, up to MAX_ANSWER_BYTES per worker
# (beyond it the rest comes in a second call).
ANSWER_BYTES = 16 << 10
MAX_ANSWER_BYTES = 4 << 20
# Requests that list the hosts' steps: a save's first call, which also polls. Told
# by their first bytes (mtc.contract.encode_request), without parsing the request.
LISTING = tuple(f'{{"op": "{op.name}"'.encode() for op in (STEPS, SURVEY))


def install_cpu_id_patch() -> None:
    """Let colocated calls resolve CPU devices across the controller/worker id split.

    On Pathways the controller names colocated CPU devices by backend-global ids
    that a worker's own CPU backend numbers differently; Orbax ships the fix
    (JAX's serialization taught to map both), installed on both sides as Orbax's
    own colocated checkpointing does. It is idempotent, and a no-op for CPU-only
    meshes. Orbax keeps it in a private module: a version without it is logged.
    """
    try:
        from orbax.checkpoint._src.multihost import colocated_transport
    except ImportError:
        log.warning("orbax-checkpoint has no colocated transport: CPU ids are not remapped")
        return
    colocated_transport.install_pathways_colocated_serialization_patch()


def _answer(value: int, ranks: jax.Array) -> jax.Array:
    """One answer per worker, on that worker's own devices (``ranks``' sharding)."""
    order = device_order(ranks.sharding, ranks.shape)
    shard = ranks.sharding.shard_shape(ranks.shape)
    return place(ranks.shape, np.dtype(np.uint8), ranks.sharding,
                 [np.full(shard, value, np.uint8) for _ in order], list(order))


def _hosts(ranks: jax.Array) -> dict[int, int]:
    """Device id -> host, for the devices this worker sees (worker-side ids)."""
    return {s.device.id: int(np.asarray(s.data).reshape(-1)[0])
            for s in ranks.addressable_shards}


class ColocatedAgent:
    """Wraps :class:`HostAgent` with array-only methods; one instance per worker.

    Every method takes ``ranks``, an int32 array with one element per worker on
    its colocated CPU device, and answers with a uint8 array sharded the same
    way: a worker reads which host it is from its own shard and writes its
    answer into its own shard, so no controller-side device id is ever used here.
    """

    def __init__(self, config_json: str) -> None:
        install_cpu_id_patch()
        config = AgentConfig.from_json(config_json)
        if HOST_ROOT is not None:
            config = dataclasses.replace(config, local_dir=str(HOST_ROOT), subdirs=False)
        self.agent = HostAgent(config)
        self.ops = HostOps(config)
        self._replies: dict[int, bytes | bytearray] = {}  # device id -> the last request's reply
        self._error: MtcError | None = None  # of the last call that answered FAILED

    def _guarded(self, fn: Callable[[], int]) -> int:
        """``fn``'s answer, or FAILED with the typed error kept for an ``error`` request
        (an exception would reach the controller as an untyped runtime error)."""
        try:
            return fn()
        except (MtcError, OSError) as e:
            self._error = typed_error(e, storage="worker")
        # The kept error holds no frame's arrays: a call's inputs (a reused slot of
        # the host's area, on the local cluster) are free once it failed.
        clear_frames(self._error)
        return FAILED

    def ask(self, request: jax.Array, ranks: jax.Array, size: jax.Array) -> jax.Array:
        """Answer a host request for this worker's host, in a fixed-size answer per
        device of ``ranks`` (``size`` bytes, a little-endian uint64, from
        ANSWER_BYTES up to MAX_ANSWER_BYTES): the reply's length (8 bytes), then as
        much of the reply as fits; the whole reply is kept for :meth:`reply`.
        Listing the steps first raises an earlier save's background error, as a
        poll would. The request ``{"op": "error"}`` is answered with the typed
        error of the last call that failed here."""
        n = int(np.asarray(size.addressable_shards[0].data).view("<u8")[0])
        if not ANSWER_BYTES <= n <= MAX_ANSWER_BYTES or n % 8:
            raise ValueError(f"an answer of {n} bytes asked for")
        req = np.asarray(request.addressable_shards[0].data).tobytes()
        hosts = _hosts(ranks)
        if req == ERROR_REQUEST:
            err = encode_error(self._error) if self._error else encode_reply(None)
            by_host = {h: err for h in set(hosts.values())}
        else:
            by_host = {h: self._handle(req, h) for h in set(hosts.values())}
        self._replies = {d: by_host[h] for d, h in hosts.items()}
        # Each device's answer, in the order of the answer's sharding (``ranks``'),
        # placed in one step.
        shape = (n * ranks.shape[0],)
        order = device_order(ranks.sharding, shape)
        return place(shape, np.dtype(np.uint8), ranks.sharding,
                     [np.frombuffer(frame(self._replies[d.id], n), np.uint8) for d in order],
                     list(order))

    def _handle(self, req: bytes, host: int) -> bytes | bytearray:
        if req.startswith(LISTING):
            try:
                self.agent.raise_background_error()
            except MtcError as e:
                return encode_error(e)
        return self.ops.handle(req, serves=[host])

    def reply(self, ranks: jax.Array, cap: jax.Array) -> jax.Array:
        """The kept reply split across this worker's devices in mesh order, each part
        zero-padded to ``cap`` bytes."""
        n = int(np.asarray(cap.addressable_shards[0].data).view("<u8")[0])
        shards = sorted(ranks.addressable_shards, key=lambda s: s.index[0].start or 0)
        part: dict[int, int] = {}  # host -> parts of its reply placed so far
        buf_of: dict[Any, np.ndarray] = {}
        for s in shards:
            h = int(np.asarray(s.data).reshape(-1)[0])
            k = part[h] = part.get(h, -1) + 1
            data = memoryview(self._replies.get(s.device.id, b""))[k * n:(k + 1) * n]
            buf = buf_of[s.device] = np.zeros(n, np.uint8)
            buf[:len(data)] = np.frombuffer(data, np.uint8)
        shape = (ranks.shape[0] * n,)
        order = device_order(ranks.sharding, shape)
        return place(shape, np.dtype(np.uint8), ranks.sharding, [buf_of[d] for d in order],
                     list(order))

    def stage(self, header: jax.Array, ranks: jax.Array, arrays: list[jax.Array],
              before: jax.Array | None = None) -> jax.Array:
        """Take this worker's shards of ``arrays`` for the save ``header`` names, after
        the host requests ``before`` (retention the save's room asked for: JSON list)."""
        raw = np.asarray(header.addressable_shards[0].data).tobytes()
        header_ = SaveHeader.from_bytes(raw)
        requests = (json.loads(np.asarray(before.addressable_shards[0].data).tobytes())
                    if before is not None else [])
        hosts = _hosts(ranks)

        def stage() -> int:
            for req in requests:
                for h in set(hosts.values()):
                    decode_reply(self.ops.handle(json.dumps(req).encode(), serves=[h]))
            return int(self.agent.stage(header_, arrays, host_of_device=hosts))

        return _answer(self._guarded(stage), ranks)

    def load(self, request: jax.Array, ranks: jax.Array) -> list[jax.Array]:
        """A restore's arrays, this worker's shards read from its own files
        (:mod:`mtc.sidecar.restore.colocated_load`). A failure is kept for the ``error``
        request, as a worker's exception reaches the controller untyped."""
        try:
            return load_regions(request, ranks, self.ops.config.root)
        except MtcError as e:
            self._error = e
            raise
        except OSError as e:
            self._error = typed_error(e, storage="worker")
            raise self._error from e

    def wait(self, ranks: jax.Array) -> jax.Array:
        def wait() -> int:
            self.agent.wait()
            return 1

        return _answer(self._guarded(wait), ranks)

    def close(self, ranks: jax.Array) -> jax.Array:
        """The manager closed: every save finished, the writer's threads joined."""
        def close() -> int:
            self.agent.close()
            self.ops.release_all()
            return 1

        return _answer(self._guarded(close), ranks)

    def poll(self, ranks: jax.Array) -> jax.Array:
        def poll() -> int:
            self.agent.raise_background_error()
            return 1

        return _answer(self._guarded(poll), ranks)


RemoteAgent = colocated_python.colocated_python_class(ColocatedAgent)
