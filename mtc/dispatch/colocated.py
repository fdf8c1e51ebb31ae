"""Host-side code through ``jax.experimental.colocated_python`` (Pathways): the
colocated-Python sidecar of each worker runs it; on the local cluster, each
host's sidecar process does (:mod:`mtc.dispatch.remote_colocated`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mtc.contract import (
    ERROR_REQUEST,
    FAILED,
    AgentConfig,
    ReadTask,
    SaveHeader,
    decode_reply,
    encode_request,
    task_to_json,
)
from mtc.dispatch.calls import HostCalls, regions_of
from mtc.dispatch.process import Sidecar
from mtc.dispatch.remote_colocated import Runtime
from mtc.errors import HostAgentError


class ColocatedDispatch(HostCalls):
    """Host-side code runs through ``jax.experimental.colocated_python`` (Pathways).

    Workers take no writer lock: a JobSet runs one controller, and a sidecar that
    outlived a crashed controller would keep its successor out."""

    host_side_lock = False

    def __init__(self, config: AgentConfig, devices: Sequence[jax.Device],
                 sidecars: dict[int, Sidecar] | None = None) -> None:
        from jax.experimental import colocated_python

        from mtc.sidecar.colocated import RemoteAgent, install_cpu_id_patch

        install_cpu_id_patch()

        self.config = config
        # One colocated CPU device per worker in the order of ``devices``; each
        # worker learns which host it is from its own element of ``_ranks`` (ids
        # of the controller's devices mean nothing on a worker).
        cpu = list(colocated_python.colocated_cpu_devices(tuple(devices)))
        rank_of: dict[Any, int] = {}
        for d, c in zip(devices, cpu, strict=True):
            rank_of.setdefault(c, config.host_of_device[d.id])
        self.cpu_devices = list(rank_of)
        self._rank_of = rank_of
        self._devices_of = {r: sum(1 for x in rank_of.values() if x == r)
                            for r in set(rank_of.values())}
        mesh = jax.sharding.Mesh(np.array(self.cpu_devices), ("hosts",))
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._per_host = NamedSharding(mesh, PartitionSpec("hosts"))
        self._ranks = jax.make_array_from_single_device_arrays(
            (len(self.cpu_devices),), self._per_host,
            [jax.device_put(np.array([rank_of[c]], np.int32), c) for c in self.cpu_devices])
        # On the local cluster, the hosts' sidecars run the programs (as workers
        # do), instead of JAX's CPU fallback in this process.
        self._runtime = (Runtime(sidecars, {c.id: r for c, r in rank_of.items()})
                         if sidecars is not None else None)
        self._answer_spec = jax.ShapeDtypeStruct((len(self.cpu_devices),), np.dtype(np.uint8),
                                                 sharding=self._per_host)
        remote: Any = RemoteAgent(config.to_json())  # type: ignore[call-arg]
        # Specialized with their output specs, so that the first call does not
        # run synchronously to infer them.
        answer = self._answer_spec
        self._stage = remote.stage.specialize(out_specs_fn=lambda *_: answer)
        self._wait = remote.wait.specialize(out_specs_fn=lambda *_: answer)
        self._poll = remote.poll.specialize(out_specs_fn=lambda *_: answer)
        # 64-bit numbers as 8 bytes: without jax_enable_x64 a worker's int64 array
        # would be int32, and the call refused for breaking its declared spec.
        lengths = jax.ShapeDtypeStruct((8 * len(self.cpu_devices),), np.dtype(np.uint8),
                                       sharding=self._per_host)
        self._ask = remote.ask.specialize(out_specs_fn=lambda *_: lengths)
        self._remote = remote
        self._fetchers: dict[int, Any] = {}

    def _call(self, op: str, hosts: Sequence[int], **args: Any) -> list[Any]:
        """The request goes to every worker; each answers for its own host (null
        when not asked about it). The reply's length comes first, then the reply
        padded to a size class, so that each size class is one specialization."""
        raw = np.frombuffer(encode_request(op, hosts, **args), dtype=np.uint8)
        return self._exchange(jax.device_put(raw, self._replicated))

    def _exchange(self, request: jax.Array) -> list[Any]:
        """Each worker's reply to ``request``, in rank order. A worker's reply comes
        back split across its devices (each carries a part, padded to a size class
        shared by the call: one specialization per class)."""
        lengths = self._ask(request, self._ranks)
        size_of: dict[int, int] = {}
        for sh in lengths.addressable_shards:
            size_of.setdefault(self._rank_of[sh.device], int(np.asarray(sh.data).view("<u8")[0]))
        per_device = max(-(-n // self._devices_of[r]) for r, n in size_of.items())
        cap = 1 << (max(per_device, 1) - 1).bit_length()
        fetch = self._fetchers.get(cap)
        if fetch is None:
            spec = jax.ShapeDtypeStruct((len(self.cpu_devices) * cap,), np.dtype(np.uint8),
                                        sharding=self._per_host)
            fetch = self._fetchers[cap] = self._remote.reply.specialize(
                out_specs_fn=lambda *_: spec)
        padded = fetch(self._ranks, jax.device_put(np.array([cap], "<u8").view(np.uint8),
                                                   self._replicated))
        parts: dict[int, list[tuple[int, np.ndarray]]] = {}
        for sh in padded.addressable_shards:
            parts.setdefault(self._rank_of[sh.device], []).append(
                (int(sh.index[0].start or 0), np.asarray(sh.data)))
        replies: dict[int, Any] = {}
        for rank, ps in parts.items():
            ps.sort(key=lambda p: p[0])  # the worker's devices in mesh order
            whole = ps[0][1] if len(ps) == 1 else np.concatenate([p for _, p in ps])
            replies[rank] = decode_reply(whole[:size_of[rank]].data)
        return [replies[r] for r in sorted(replies)]

    def _unanimous(self, answer: jax.Array, op: str) -> bool:
        """Every worker's answer, read from its own shard; they must agree. A worker
        that failed answers FAILED: its typed error (step, host, file) is fetched."""
        values = {int(np.asarray(s.data).reshape(-1)[0]) for s in answer.addressable_shards}
        if FAILED in values:
            self._raise_worker_error(op)
        if len(values) != 1:
            raise HostAgentError(f"{op}: workers answered differently: {sorted(values)}")
        return bool(values.pop())

    def _raise_worker_error(self, op: str) -> None:
        raw = np.frombuffer(ERROR_REQUEST, dtype=np.uint8)
        self._exchange(jax.device_put(raw, self._replicated))  # raises the typed error
        raise HostAgentError(f"{op}: a worker failed and kept no error")

    def _fetch(self, step: int, by_host: dict[int, list[ReadTask]]
               ) -> dict[int, list[np.ndarray]]:
        """One request to every worker, each reading its own host's tasks: the hosts'
        reads run side by side instead of a call per host."""
        raw = np.frombuffer(encode_request(
            "read", sorted(by_host), step=step,
            tasks={str(h): [task_to_json(t) for t in ts] for h, ts in by_host.items()}),
            dtype=np.uint8)
        replies = dict(zip(sorted(set(self._rank_of.values())),
                           self._exchange(jax.device_put(raw, self._replicated)), strict=True))
        return {h: regions_of(ts, replies[h]) for h, ts in by_host.items()}

    def _to_cpu(self, x: jax.Array | np.ndarray) -> jax.Array:
        """The array on the colocated CPU devices, over the one device list that
        colocated calls require; arrays on another device list (a scalar on one
        device) are replicated onto it."""
        from jax.experimental import colocated_python

        if isinstance(x, np.ndarray):  # as bytes: JAX would narrow 64-bit dtypes
            return jax.device_put(np.ascontiguousarray(x).reshape(-1).view(np.uint8),
                                  self._replicated)
        s = x.sharding
        if isinstance(s, NamedSharding):
            cpu_mesh = colocated_python.colocated_cpu_devices(s.mesh)  # type: ignore[arg-type]
            if list(cpu_mesh.devices.flat) == self.cpu_devices:
                if cpu_mesh is s.mesh or list(s.mesh.devices.flat) == self.cpu_devices:
                    return x
                return jax.device_put(x, NamedSharding(cpu_mesh, s.spec))
        return jax.device_put(x, self._replicated)

    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray]) -> bool:
        raw = np.frombuffer(header.to_bytes(), dtype=np.uint8)
        header_arr = jax.device_put(raw, self._replicated)
        ok = self._stage(header_arr, self._ranks, [self._to_cpu(a) for a in arrays])
        return self._unanimous(ok, "stage")

    def wait(self) -> None:
        self._unanimous(self._wait(self._ranks), "wait")

    def raise_background_error(self) -> None:
        self._unanimous(self._poll(self._ranks), "poll")

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._runtime is not None:
                self._runtime.close()
