"""The local cluster's colocated-Python runtime, controller half.

JAX's colocated Python compiles a function into a program that Pathways runs in
the colocated-Python sidecar of every worker; on CPU devices JAX runs it in the
calling process instead, and checks nothing. While a :class:`Runtime` is
registered for a set of CPU devices, it takes that step for programs on them:
the function and its specs are pickled by JAX's own colocated serialization, as
for a real program, and every call sends the program with each host's shards of
the inputs to that host's sidecar (:mod:`mtc.sidecar.host.colocated`), which runs
it on devices of its own and answers with its shards of the outputs. They are
assembled here on the declared shardings. A call succeeds only when every host
does; a host's typed error comes back as itself.

Input and output bytes cross through each host's shared-memory area
(:func:`mtc.transfer.pack_message`), never through a RAM disk; large ones
through reused slots of it (:mod:`mtc.slots`): a save's shards through the
controller's, as a worker copies them into host buffers it reuses, and a
restore's arrays through the host's, reused once the arrays that adopted them
here are gone.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import wait
from typing import Any

import grpc
import jax
import numpy as np
from jax import tree_util

from mtc import errors, slots, transfer
from mtc.contract import error_from
from mtc.dispatch.process import Sidecar, channels
from mtc.dispatch.protocol import WorkerLostError
from mtc.errors import ColocatedCallError, ShardUnavailableError
from mtc.pool import ThreadPool
from mtc.shards import ShardLayout

METHOD = "/mtc.Host/Execute"

_lock = threading.Lock()
_runtimes: list[Runtime] = []
# The runtime a dispatcher's call is being made through (JAX compiles a program
# inside the call that first needs it): two managers over the same CPU devices
# (two clusters, or a resized job's) each reach their own hosts.
_serving: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar(
    "mtc_colocated_runtime", default=None)
_original: Callable[..., Any] | None = None  # JAX's own step, while one is registered
# Host views of a call's inputs taken when the call was made, by id of the input:
# the call may run after the caller's next step donated them (jax 0.12.1 marks a
# donated array deleted even where a view kept its buffer).
Held = dict[int, list[tuple[int, np.ndarray]]]
_held: contextvars.ContextVar[Held | None] = contextvars.ContextVar(
    "mtc_colocated_held", default=None)


def host_views(name: str, arrays: list[jax.Array], host_of_device: Mapping[int, int]) -> Held:
    """(device id, host view) of every shard of ``arrays`` (CPU devices: no copy),
    by id of the array; a shard lost with its host raises :class:`WorkerLostError`
    naming the host (``host_of_device``: CPU device id -> host)."""
    return {id(a): _shard_views(name, a, host_of_device) for a in arrays}


def _shard_views(name: str, x: jax.Array,
                 host_of_device: Mapping[int, int]) -> list[tuple[int, np.ndarray]]:
    out = []
    for s in x.addressable_shards:
        try:
            out.append((s.device.id, np.asarray(s.data)))
        except jax.errors.JaxRuntimeError as e:  # a device lost with its host
            raise WorkerLostError(f"{name}: an input's shard on device {s.device.id} "
                                  f"is gone: {e}", host=host_of_device.get(s.device.id)) from e
    return out


@contextlib.contextmanager
def holding(held: Held | None) -> Iterator[None]:
    """Calls made meanwhile (on this thread) read these inputs from ``held``."""
    token = _held.set(held)
    try:
        yield
    finally:
        _held.reset(token)


def _compile(name: str, fun: Callable[..., Any], in_specs_treedef: Any,
             in_specs_leaves: tuple[Any, ...], out_specs_treedef: Any,
             out_specs_leaves: tuple[Any, ...], devices: Any) -> Callable[..., Any]:
    """Stands in for ``colocated_python.func._compile_to_executable``: the program
    goes to the hosts of the runtime the calling dispatcher serves through
    (:meth:`Runtime.serving`), else of the newest runtime over its devices."""
    ids = {d.id for d in devices}
    current = _serving.get()
    with _lock:
        # The newest first: a manager made for a resized mesh before the old one closed.
        runtime = next((r for r in ([current] if current is not None else reversed(_runtimes))
                        if ids <= set(r.host_of_device)), None)
    if runtime is None:  # not in-process either: that would check nothing
        raise ColocatedCallError(f"{name}: no host serves CPU devices {sorted(ids)}")
    return runtime.compile(name, fun, in_specs_treedef, in_specs_leaves, out_specs_treedef,
                           out_specs_leaves, devices)


def _register(runtime: Runtime) -> None:
    global _original
    from jax.experimental.colocated_python import func

    with _lock:
        if not _runtimes:
            _original = func._compile_to_executable
            func._compile_to_executable = _compile
        _runtimes.append(runtime)


def _unregister(runtime: Runtime) -> None:
    global _original
    from jax.experimental.colocated_python import func

    with _lock:
        if runtime in _runtimes:
            _runtimes.remove(runtime)
        if not _runtimes and _original is not None:
            func._compile_to_executable = _original
            _original = None


class Runtime:
    """Runs colocated programs on the devices of ``host_of_device`` (CPU device id ->
    host rank) in the hosts' sidecars (``sidecars``: rank -> where it listens).
    Registered from construction until :meth:`close`."""

    def __init__(self, sidecars: dict[int, Sidecar], host_of_device: dict[int, int],
                 *, deadline_s: float = 120.0) -> None:
        missing = sorted(set(host_of_device.values()) - set(sidecars))
        if missing:
            raise errors.ConfigError(f"no sidecar for hosts {missing}")
        self.sidecars = sidecars
        self.host_of_device = dict(host_of_device)
        self.deadline_s = deadline_s
        creds = next((s.creds for s in sidecars.values()), None)
        self._channels, self._stubs = channels(sidecars, METHOD, creds)
        self._pool = ThreadPool(max(1, len(sidecars)), "mtc-coloc")
        self._programs: set[str] = set()  # every program compiled here
        # Per host, how many times its sidecar may have restarted (a call that did not
        # reach it, a reply from a new one): a program sent to it before is sent
        # again with its next call, not after a round trip that finds it unknown.
        self._epoch = dict.fromkeys(sidecars, 0)
        self._epoch_lock = threading.Lock()
        self._slots = {h: slots.SlotPool(s.area) for h, s in sidecars.items()}
        # Each host's reply slots, mapped once; every call reports which uses of
        # them arrays here still hold (a restore's arrays adopt the mapping).
        self._replies = {h: slots.SlotMaps(s.area, prefix=slots.REPLY_PREFIX)
                         for h, s in sidecars.items()}
        _register(self)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Programs JAX compiles meanwhile (on this thread) go to this runtime's hosts."""
        token = _serving.set(self)
        try:
            yield
        finally:
            _serving.reset(token)

    def close(self) -> None:
        """Unregistered, and every host told to drop the programs (and with them
        the worker objects they hold) compiled here and this runtime's slots, whose
        files go: a controller that restarts many times leaves nothing of its old
        ones in the sidecars."""
        _unregister(self)
        if self._programs:
            forget = {h: self._pool.submit(self._forget, h) for h in self.sidecars}
            wait(forget.values())
        self._pool.shutdown(wait=True)
        for pool in self._slots.values():
            pool.close()
        for maps in self._replies.values():
            maps.forget_all()
        for c in self._channels.values():
            c.close()

    def _restarted(self, h: int) -> None:
        with self._epoch_lock:
            self._epoch[h] += 1

    def _forget(self, h: int) -> None:
        message = transfer.pack_message(self.sidecars[h].area,
                                        {"forget": sorted(self._programs),
                                         "slots": self._slots[h].names,
                                         "replies": {"boot": self._replies[h].boot}}, [])
        try:
            self._stubs[h](message, timeout=self.deadline_s)
        except grpc.RpcError:
            pass  # a host gone takes its programs with it

    def compile(self, name: str, fun: Callable[..., Any], in_treedef: Any,
                in_specs: tuple[Any, ...], out_treedef: Any, out_specs: tuple[Any, ...],
                devices: Any) -> Callable[..., Any]:
        """What JAX calls for each input of a specialized function: the program,
        pickled once, sent to each host on its first call there."""
        from jax.experimental.colocated_python import func as jax_func
        from jax.experimental.colocated_python import serialization

        # PRNG keys cross as JAX's own compile step converts them: as their key
        # data, wrapped back into keys on either side (JAX's helpers, where this
        # version has them; refused below otherwise).
        prng_in: dict[int, str] = {}
        prng_out: dict[int, str] = {}
        if hasattr(jax_func, "_make_prng_wrapped_fun"):
            prng_in = jax_func._get_prng_key_info(in_specs)
            prng_out = jax_func._get_prng_key_info(out_specs)
            if prng_in or prng_out:
                in_specs = jax_func._convert_inp_type_to_physical(in_specs, prng_in)
                out_specs = jax_func._convert_inp_type_to_physical(out_specs, prng_out)
                fun = jax_func._make_prng_wrapped_fun(fun, prng_in, prng_out)
        for s in (*in_specs, *out_specs):
            if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
                raise ColocatedCallError(f"{name}: PRNG key arrays cannot cross here")
        pickled = serialization._serialize(
            (fun, in_treedef, in_specs, out_treedef, out_specs, devices))
        pid = transfer.program_id(pickled)
        self._programs.add(pid)
        ids = [d.id for d in devices]
        hosts = sorted({self.host_of_device[i] for i in ids})
        own = {h: [i for i in ids if self.host_of_device[i] == h] for h in hosts}
        by_id = {d.id: d for d in devices}
        out_layouts = [ShardLayout(spec) for spec in out_specs]  # worked out once
        sent: dict[int, int] = {}  # host -> the epoch of its sidecar the program went to
        lock = threading.Lock()

        def one(h: int, inputs: list[list[list[int]]], buffers: list[np.ndarray]
                ) -> tuple[dict[str, Any], list[np.ndarray]]:
            header = {"program": pid, "name": name, "devices": ids, "own": own[h],
                      "inputs": inputs}
            area = self.sidecars[h].area
            for _ in range(2):  # once more with the program, for a sidecar that lacks it
                with lock, self._epoch_lock:
                    first = sent.get(h) != self._epoch[h]
                parts = [*buffers, np.frombuffer(pickled, np.uint8)] if first else buffers
                replies = self._replies[h]
                message = transfer.pack_message(
                    area, {**header, "pickled": first,
                           "replies": {"boot": replies.boot, "slots": replies.report()}},
                    parts, self._slots[h])
                try:
                    reply = self._stubs[h](message, timeout=self.deadline_s)
                except grpc.RpcError as e:  # a slot it filled stays busy: the host may hold it
                    self._restarted(h)  # whoever answers next may be a new sidecar
                    raise ShardUnavailableError(
                        f"{name}: sidecar unreachable: {e.code().name}: {e.details()}",
                        host=h) from None
                got, data = transfer.unpack_message(area, reply, replies)
                if self._slots[h].update(got):
                    replies.forget_all()  # a restarted sidecar: its predecessor's are gone
                    self._restarted(h)  # and it has none of the programs sent before
                if "error" in got:
                    raise error_from(got["error"], default=ColocatedCallError, host=h)
                if not got.get("unknown_program"):
                    with lock, self._epoch_lock:
                        sent[h] = self._epoch[h]
                    return got, data
                with lock:
                    sent.pop(h, None)
            raise ColocatedCallError(f"{name}: the sidecar did not keep the program", host=h)

        def call(*args: Any, **kwargs: Any) -> Any:
            leaves = tree_util.tree_leaves((args, kwargs))
            if prng_in:
                leaves = jax_func._unwrap_prng_keys(leaves, prng_in)
            inputs: dict[int, list[list[list[int]]]] = {h: [] for h in hosts}
            buffers: dict[int, list[np.ndarray]] = {h: [] for h in hosts}
            held = _held.get() or {}
            for x in leaves:
                for h in hosts:
                    inputs[h].append([])
                views = held.get(id(x)) or _shard_views(name, x, self.host_of_device)
                for device_id, data in views:
                    h = self.host_of_device[device_id]
                    inputs[h][-1].append([device_id, len(buffers[h])])
                    buffers[h].append(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
            futures = {h: self._pool.submit(one, h, inputs[h], buffers[h]) for h in hosts}
            wait(futures.values())  # every host answered, whatever the first one raised
            replies = {h: f.result() for h, f in sorted(futures.items())}
            # Each output made from every host's shards of it in one placement (a
            # restore's answer is hundreds of shards: one call each cost more).
            results = []
            for k, layout in enumerate(out_layouts):
                came = [(int(cid), out[int(b)]) for got, out in replies.values()
                        for cid, b in got["outputs"][k]]
                ids = sorted(c for c, _ in came)
                want = sorted(d.id for d in layout.devices)
                if ids != want:
                    raise ColocatedCallError(f"{name}: output {k} came back on devices "
                                             f"{ids}, declared {want}")
                results.append(layout.array({by_id[c]: raw for c, raw in came}))
            if prng_out:
                results = jax_func._wrap_prng_keys(results, prng_out)
            return tree_util.tree_unflatten(out_treedef, results)

        return call
