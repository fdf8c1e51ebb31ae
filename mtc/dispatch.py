"""How the controller reaches host-side code: the host seam.

Every host operation goes through a dispatcher: stage and write a save, wait for
it, load a restore's shards, and the small operations of :class:`HostCalls`
(list committed steps, read a manifest, read a region, delete, retain, clean).
The controller never opens, lists or deletes anything under a RAM disk itself.
Two dispatchers exist, driving the same host-side code (``sidecar/``): in this
process (multi-controller JAX, where each process is its own host; simulated
hosts) or through colocated Python (Pathways); they differ only in how requests
and bytes travel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mtc.contract import (
    AgentConfig,
    LeafSpec,
    ReadTask,
    SaveHeader,
    decode_reply,
    encode_request,
    task_to_json,
)
from mtc.errors import HostAgentError, ManifestError
from mtc.manifest import MANIFEST_NAME, Manifest
from sidecar.agent import HostAgent
from sidecar.load import ShardLoader, load_leaves
from sidecar.ops import HostOps


class Dispatch(Protocol):
    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray]) -> bool: ...
    def wait(self) -> None: ...
    def raise_background_error(self) -> None: ...
    def load(self, step: int, tasks: Sequence[ReadTask],
             specs: dict[int, LeafSpec]) -> dict[int, jax.Array]: ...
    def steps(self, hosts: Sequence[int]) -> dict[int, list[int]]: ...
    def manifest(self, step: int, host: int) -> Manifest: ...
    def read(self, step: int, host: int, task: ReadTask) -> np.ndarray: ...
    def delete(self, step: int, hosts: Sequence[int]) -> None: ...
    def retain(self, oldest_kept: int, hosts: Sequence[int]) -> None: ...
    def clean(self, hosts: Sequence[int]) -> dict[int, list[str]]: ...
    def close(self) -> None: ...


class HostCalls:
    """The small host operations, as typed calls over one request/reply channel."""

    def _call(self, op: str, hosts: Sequence[int], **args: Any) -> list[Any]:
        """Every answering host process's decoded reply (typed errors raised)."""
        raise NotImplementedError

    def steps(self, hosts: Sequence[int]) -> dict[int, list[int]]:
        """Committed steps of every host reachable (``hosts``, and with host
        subfolders the roots beside them)."""
        out: dict[int, list[int]] = {}
        for reply in self._call("steps", hosts):
            for h, steps in (reply or {}).items():
                out[int(h)] = [int(s) for s in steps]
        return out

    def _one(self, op: str, host: int, **args: Any) -> Any:
        found = [r for r in self._call(op, [host], **args) if r is not None]
        if len(found) != 1:
            raise HostAgentError(f"{op}: {len(found)} host processes answered for one host",
                                 host=host)
        return found[0]

    def manifest(self, step: int, host: int) -> Manifest:
        path = f"host {host}: {step}/{MANIFEST_NAME}"
        m = Manifest.from_bytes(self._one("manifest", host, step=step), path=path)
        if m.step != step or m.host != host:
            raise ManifestError(f"manifest belongs to step {m.step} host {m.host}", step=step,
                                host=host, path=path)
        return m

    def read(self, step: int, host: int, task: ReadTask) -> np.ndarray:
        """A region of one leaf from pieces ``host`` holds, verified there; a copy."""
        raw = self._one("read", host, step=step, task=task_to_json(task))
        return np.frombuffer(bytearray(raw), dtype=jax.numpy.dtype(task.dtype)).reshape(
            task.shape)

    def delete(self, step: int, hosts: Sequence[int]) -> None:
        self._call("delete", hosts, step=step)

    def retain(self, oldest_kept: int, hosts: Sequence[int]) -> None:
        """Remove every committed step older than ``oldest_kept`` on ``hosts``."""
        self._call("retain", hosts, oldest_kept=oldest_kept)

    def clean(self, hosts: Sequence[int]) -> dict[int, list[str]]:
        """Remove uncommitted and half-deleted folders; their names by host."""
        out: dict[int, list[str]] = {}
        for reply in self._call("clean", hosts):
            for h, names in (reply or {}).items():
                out[int(h)] = list(names)
        return out


class LocalDispatch(HostCalls):
    """Host-side code runs in this process (multi-controller JAX, simulated hosts)."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.agent = HostAgent(config)
        self.ops = HostOps(config)

    def _call(self, op: str, hosts: Sequence[int], **args: Any) -> list[Any]:
        return [decode_reply(self.ops.handle(encode_request(op, hosts, **args)))]

    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray]) -> bool:
        return self.agent.stage(header, arrays)

    def wait(self) -> None:
        self.agent.wait()

    def raise_background_error(self) -> None:
        self.agent.raise_background_error()

    def load(self, step: int, tasks: Sequence[ReadTask],
             specs: dict[int, LeafSpec]) -> dict[int, jax.Array]:
        return load_leaves(ShardLoader(step, self.config.root), tasks, specs)

    def close(self) -> None:
        self.agent.close()


class ColocatedDispatch(HostCalls):
    """Host-side code runs through ``jax.experimental.colocated_python`` (Pathways)."""

    def __init__(self, config: AgentConfig, devices: Sequence[jax.Device]) -> None:
        from jax.experimental import colocated_python

        from sidecar.colocated import RemoteAgent

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
        mesh = jax.sharding.Mesh(np.array(self.cpu_devices), ("hosts",))
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._per_host = NamedSharding(mesh, PartitionSpec("hosts"))
        self._ranks = jax.make_array_from_single_device_arrays(
            (len(self.cpu_devices),), self._per_host,
            [jax.device_put(np.array([rank_of[c]], np.int32), c) for c in self.cpu_devices])
        self._answer_spec = jax.ShapeDtypeStruct((len(self.cpu_devices),), np.dtype(np.uint8),
                                                 sharding=self._per_host)
        remote: Any = RemoteAgent(config.to_json())  # type: ignore[call-arg]
        # Specialized with their output specs, so that the first call does not
        # run synchronously to infer them.
        answer = self._answer_spec
        self._stage = remote.stage.specialize(out_specs_fn=lambda *_: answer)
        self._wait = remote.wait.specialize(out_specs_fn=lambda *_: answer)
        self._poll = remote.poll.specialize(out_specs_fn=lambda *_: answer)
        lengths = jax.ShapeDtypeStruct((len(self.cpu_devices),), np.dtype(np.int64),
                                       sharding=self._per_host)
        self._ask = remote.ask.specialize(out_specs_fn=lambda *_: lengths)
        self._remote = remote
        self._fetchers: dict[int, Any] = {}

    def _call(self, op: str, hosts: Sequence[int], **args: Any) -> list[Any]:
        """The request goes to every worker; each answers for its own host (null
        when not asked about it). The reply's length comes first, then the reply
        padded to a size class, so that each size class is one specialization."""
        raw = np.frombuffer(encode_request(op, hosts, **args), dtype=np.uint8)
        lengths = self._ask(jax.device_put(raw, self._replicated), self._ranks)
        sizes = [int(np.asarray(sh.data).reshape(-1)[0]) for sh in lengths.addressable_shards]
        cap = 1 << max(max(sizes), 1).bit_length()
        fetch = self._fetchers.get(cap)
        if fetch is None:
            spec = jax.ShapeDtypeStruct((len(self.cpu_devices) * cap,), np.dtype(np.uint8),
                                        sharding=self._per_host)
            fetch = self._fetchers[cap] = self._remote.reply.specialize(
                out_specs_fn=lambda *_: spec)
        padded = fetch(self._ranks, jax.device_put(np.int64(cap), self._replicated))
        by_device = {sh.device: n for sh, n in zip(lengths.addressable_shards, sizes,
                                                   strict=True)}
        replies: dict[int, Any] = {}
        for sh in padded.addressable_shards:
            rank = self._rank_of[sh.device]
            if rank not in replies:  # a worker's devices carry the same reply
                data = np.asarray(sh.data)[:by_device[sh.device]].tobytes()
                replies[rank] = decode_reply(data)
        return [replies[r] for r in sorted(replies)]

    @staticmethod
    def _unanimous(answer: jax.Array, op: str) -> bool:
        """Every worker's answer, read from its own shard; they must agree."""
        values = {int(np.asarray(s.data).reshape(-1)[0]) for s in answer.addressable_shards}
        if len(values) != 1:
            raise HostAgentError(f"{op}: workers answered differently: {sorted(values)}")
        return bool(values.pop())

    def _token(self) -> jax.Array:
        return jax.device_put(np.uint8(0), self._replicated)

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

    def load(self, step: int, tasks: Sequence[ReadTask],
             specs: dict[int, LeafSpec]) -> dict[int, jax.Array]:
        from sidecar.colocated import remote_load

        arrays = remote_load(self.config.to_json(), step, tasks, specs, self._token())
        return dict(zip(sorted(specs), arrays, strict=True))

    def close(self) -> None:
        self.wait()
