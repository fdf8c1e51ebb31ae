"""The colocated-Python server of the local cluster, in each host's sidecar process.

On Pathways the controller's ``jax.experimental.colocated_python`` calls run in
the colocated-Python sidecar of every worker. Here each host's sidecar plays that
server for the controller's runtime (:mod:`mtc.dispatch.remote_colocated`): it
gets a program (the function and its specs, pickled by JAX's own colocated-Python
serialization) with this host's shards of the inputs, runs it on CPU devices of
its own, checks the result against the declared output specs, and sends back
this host's shards of the outputs.

What a program is held to, as on a worker:

- The function sees the job's global arrays, of which only this host's shards
  are addressable: the sidecar's JAX is process 1 of a two-process CPU job whose
  process 0 (:mod:`.ghost`) holds the other hosts' devices, as a worker's JAX
  sees the whole job's devices and holds its own.
- Device ids in a program are the controller's. They resolve through a map built
  per program (Pathways resolves them as backend-global ids; Orbax's patch
  teaches JAX that): this host's onto this process's devices, whose own ids
  (2048 and up) are none of the controller's; the others onto the other
  process's. This host's part of the map is Orbax's own parser's, run over its
  devices shown as a Pathways worker shows them (:mod:`.pathways_ids`). Code that
  looks a device up by a controller id finds one that is not this host's, and an
  id outside the program's device list (a controller device that leaked into a
  closure) does not resolve at all.
- A result must have the declared tree, dtypes, shapes and sharding, with its
  addressable shards on exactly this host's devices of that sharding.

JAX starts on a thread started with the server (a few seconds here, with the
other process), so that the first call after a host's start does not wait for
all of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mtc import slots, transfer
from mtc.contract import error_fields
from mtc.errors import ColocatedCallError, MtcError, ProtocolError
from mtc.lifecycle import Threads
from mtc.pool import ThreadPool
from mtc.ports import free_ports
from mtc.shards import ShardLayout
from mtc.sidecar.host import ghost, pathways_ids

if TYPE_CHECKING:
    import jax

log = logging.getLogger(__name__)
# Controllers whose reply slots a host keeps: one closing while the next starts.
REPLY_POOLS = 2
_BOOT = re.compile(r"[0-9a-f]{32}")
# A call whose arrays hold more has them released off the call's path.
RELEASE_OFF_CALL_BYTES = 1 << 20
_DESERIALIZE = threading.Lock()  # JAX's deserializer keeps per-process state


class _Program:
    """A deserialized program and the device map it was resolved with: the
    controller's ids of this host's devices onto this process's own devices, the
    program's other ids onto the other process's (the rest of the job)."""

    def __init__(self, pickled: bytes, device_ids: list[int], own_ids: list[int]) -> None:
        import jax
        from jax.experimental.colocated_python import serialization

        mine, others = jax.local_devices(), [d for d in jax.devices()
                                             if d.process_index != jax.process_index()]
        own = sorted(own_ids)
        rest = sorted(set(device_ids) - set(own))
        if len(own) > len(mine) or len(rest) > len(others):
            raise ColocatedCallError(
                f"the program spans {len(own)} devices of this host and {len(rest)} others; "
                f"this host's runtime has {len(mine)} and {len(others)}")
        with _DESERIALIZE:
            # This host's devices: resolved by Orbax's own parser over them shown as
            # a Pathways worker shows them (its global id in the repr), as Orbax's
            # patch resolves them on a worker. The rest of the job's are the
            # emulation's own (how a worker's runtime lists other hosts' devices is
            # for a real Pathways cluster to show: docs/hosts.md).
            self.device_of = {**pathways_ids.resolve(dict(zip(own, mine, strict=False))),
                              **dict(zip(rest, others, strict=False))}
            with _resolving(serialization, self.device_of):
                (self.fun, self.in_treedef, self.in_specs, self.out_treedef,
                 self.out_specs, self.devices) = serialization._deserialize(pickled)
        self.id_of = {d: c for c, d in self.device_of.items()}
        self.inputs = [ShardLayout(spec) for spec in self.in_specs]


def _error_message(host: int, area: Path, e: MtcError, **extra: Any) -> bytes:
    return transfer.pack_message(area, {"error": {
        **error_fields(e), "host": host if e.host is None else e.host}, **extra}, [])


@contextmanager
def _resolving(serialization: Any, device_of: dict[int, jax.Device]) -> Iterator[None]:
    """JAX's deserializer resolves CPU ids through ``_get_cpu_device_map``: this
    program's map while it runs (Orbax's patch, if a program installed it, after)."""
    saved = serialization._get_cpu_device_map
    serialization._get_cpu_device_map = lambda: device_of
    try:
        yield
    finally:
        serialization._get_cpu_device_map = saved


class ColocatedServer:
    """Runs one host's colocated-Python programs, one call at a time (a worker runs
    its programs in the order they were issued), on ``own_devices`` CPU devices of
    a JAX whose other ``job_devices - own_devices`` belong to the rest of the job
    (:mod:`.ghost`)."""

    def __init__(self, host: int, area: Path, root: Path, own_devices: int,
                 job_devices: int, *, latency_s: float = 0.0) -> None:
        self.host = host
        # Every call's cost beyond its work: the hop through Pathways' proxy.
        self.latency_s = latency_s
        self.area = area
        self.root = root
        self._own, self._others = own_devices, job_devices - own_devices
        if self._own < 1 or self._others < 0:
            raise ValueError(f"{own_devices} devices of {job_devices}")
        self._programs: dict[str, _Program] = {}
        # The controller's reused input slots, mapped once; every reply reports them.
        self._slots = slots.SlotMaps(area)
        # Reply slots: a call's output shards (a restore's arrays) go back through
        # slots of the area this host fills and reuses once the controller reports
        # its arrays over them gone (fresh tmpfs pages cost about twice pages held).
        # One pool per controller runtime (its report's boot id), the newest
        # REPLY_POOLS kept: a killed controller's slots go when a new one comes.
        self._replies: OrderedDict[str, slots.SlotPool] = OrderedDict()
        # A predecessor's reply slots (this host's alone write them): a killed
        # sidecar's go when its successor starts (a controller's mapping keeps its
        # pages while its arrays live).
        for name in os.listdir(area):
            if name.startswith(slots.REPLY_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(area / name)
        self._run = threading.Lock()
        # A call's arrays are let go on this thread once its reply is built. JAX
        # releases an array's host memory lazily, inside the next transfer to a
        # device; a restore's outputs are mapped RAM-disk files whose unmapping
        # (tens of ms per host) would otherwise land in the controller's next call
        # (the next save's stall). A worker's runtime frees a call's buffers off the
        # call path in the same way.
        self._release = ThreadPool(1, "mtc-colocated-release")
        self._ghost: subprocess.Popen[bytes] | None = None
        self._address = ""
        if self._others:
            # Started from this thread, the process's main one: the other process
            # dies with the thread that started it (PR_SET_PDEATHSIG).
            self._address = f"127.0.0.1:{free_ports(1)[0]}"  # the host's own loopback
            self._ghost = subprocess.Popen([sys.executable, "-m", "mtc.sidecar.host.ghost",
                                            self._address, str(self._others)])
        self._ready = threading.Event()
        self._warm_error: BaseException | None = None
        # A daemon: JAX's start may hang on a peer that never comes (the ghost), and
        # a sidecar that is told to exit must not wait for it.
        self._threads = Threads("mtc-colocated")
        self._threads.start(self._start_jax, "mtc-colocated-warm", daemon=True)

    def _start_jax(self) -> None:
        try:
            flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count")]
            os.environ["XLA_FLAGS"] = " ".join(
                [*flags, f"--xla_force_host_platform_device_count={self._own}"])
            import jax

            jax.config.update("jax_platforms", "cpu")
            if self._others:
                jax.distributed.initialize(self._address, num_processes=2, process_id=1,
                                           initialization_timeout=ghost.TIMEOUT_S,
                                           heartbeat_timeout_seconds=ghost.NEVER_S,
                                           shutdown_timeout_seconds=1)
            jax.devices()
            # The worker-side objects a controller's programs name (they come by
            # reference), with this host's RAM disk where this process keeps it.
            import mtc.sidecar.colocated as agents

            agents.HOST_ROOT = self.root
            agents.install_cpu_id_patch()  # imports Orbax (a second): before any call
        except BaseException as e:  # noqa: BLE001 (reported by every call)
            self._warm_error = e
            log.error("host %d: colocated runtime did not start: %r", self.host, e)
        finally:
            self._ready.set()

    def wait_ready(self) -> None:
        """Until JAX has started (or failed to: every call then says so)."""
        self._ready.wait()

    @property
    def programs(self) -> int:
        """How many programs this host keeps."""
        return len(self._programs)

    def close(self) -> None:
        """Ends the other process (JAX takes SIGTERM as a preemption notice); the
        reply slots' files go (a controller's mappings keep their pages)."""
        self._threads.join(reraise=False)  # its error is every call's answer (execute)
        self._release.shutdown(wait=True)
        with self._run:
            while self._replies:
                self._replies.popitem()[1].close()
        if self._ghost is not None:
            self._ghost.kill()
            self._ghost.wait()

    @staticmethod
    def refuse(host: int, area: Path) -> bytes:
        """The answer of a sidecar that runs no colocated Python."""
        return _error_message(host, area, ColocatedCallError(
            "this sidecar runs no colocated Python (start it with --colocated-devices)"))

    def _slot_state(self) -> dict[str, Any]:
        """For every reply: which of the controller's slots this host still reads."""
        return {"boot": self._slots.boot, "slots": self._slots.report()}

    def execute(self, message: bytes) -> bytes:
        """One call: the reply carries this host's output shards, or the error."""
        try:
            self._ready.wait()
            if self._warm_error is not None:
                raise ColocatedCallError(f"JAX did not start: {self._warm_error!r}")
            header, buffers = transfer.unpack_message(self.area, message, self._slots)
            if "forget" in header:  # a controller that closed: its programs go
                with self._run:
                    for pid in header["forget"]:
                        self._programs.pop(str(pid), None)
                    self._slots.drop([str(n) for n in header.get("slots", [])])
                    pool = self._replies.pop(_boot_of(header.get("replies")) or "", None)
                    if pool is not None:
                        pool.close()
                return transfer.pack_message(self.area, {"forgot": True}, [])
            if self.latency_s:
                time.sleep(self.latency_s)
            with self._run:
                reply, held = self._execute(header, buffers, self._reply_pool(header))
            if _nbytes(held) < RELEASE_OFF_CALL_BYTES:
                held.clear()  # a small call's memory: nothing worth a thread's wake-up
                return reply
            try:
                self._release.submit(_let_go, held)
            except RuntimeError:  # closing: let go here
                _let_go(held)
            return reply
        except MtcError as e:
            return _error_message(self.host, self.area, e, **self._slot_state())
        except (ValueError, KeyError, TypeError, IndexError, RecursionError, OSError) as e:
            # An OSError's text names the file (the server's area): only its reason.
            what = (f"{type(e).__name__}: {e.strerror}" if isinstance(e, OSError)
                    else repr(e)[:300])
            return _error_message(self.host, self.area,
                                  ProtocolError(f"malformed colocated call: {what}"),
                                  **self._slot_state())

    def _reply_pool(self, header: dict[str, Any]) -> slots.SlotPool | None:
        """The reply slots of the controller that sent ``header``, freed as its report
        says (the uses it no longer maps); None for a caller that maps none."""
        report = header.get("replies")
        boot = _boot_of(report)
        if boot is None or not isinstance(report, dict):
            return None
        pool = self._replies.get(boot)
        if pool is None:
            pool = self._replies[boot] = slots.SlotPool(self.area, prefix=slots.REPLY_PREFIX)
            while len(self._replies) > REPLY_POOLS:  # the oldest controller's go
                self._replies.popitem(last=False)[1].close()
        self._replies.move_to_end(boot)
        pool.update(report)
        return pool

    def _program(self, header: dict[str, Any], buffers: list[np.ndarray]) -> _Program | None:
        pid = str(header["program"])
        prog = self._programs.get(pid)
        # A controller that cannot tell whether this sidecar is the one it sent the
        # program to (it restarted, or a call did not arrive) sends it again.
        sent = buffers.pop() if header.get("pickled") else None
        if prog is None and sent is not None:
            pickled = sent.tobytes()
            if transfer.program_id(pickled) != pid:
                raise ProtocolError(f"program {pid} arrived with other bytes")
            try:
                prog = _Program(pickled, [int(i) for i in header["devices"]],
                                [int(i) for i in header["own"]])
            except MtcError:
                raise
            except Exception as e:  # as a worker refuses a program naming foreign devices
                raise ColocatedCallError(f"{header['name']}: the program does not load on "
                                         f"this host: {type(e).__name__}: {e}") from e
            self._programs[pid] = prog
        return prog

    def _execute(self, header: dict[str, Any], buffers: list[np.ndarray],
                 replies: slots.SlotPool | None) -> tuple[bytes, list[Any]]:
        """The reply (its shards in a free slot of ``replies`` where one is), and the
        call's arrays (its inputs and outputs) to let go."""
        from jax import tree_util

        prog = self._program(header, buffers)
        if prog is None:  # this sidecar started after the controller sent it
            return transfer.pack_message(self.area, {"unknown_program": True,
                                                     **self._slot_state()}, []), []
        name = str(header["name"])
        leaves: list[Any] = []
        inputs = header["inputs"]
        if len(inputs) != len(prog.in_specs):
            raise ProtocolError(f"{name}: {len(inputs)} inputs for {len(prog.in_specs)} specs")
        # Each input made from this host's shards in one step (JAX places them
        # at once: a call's fixed cost is mostly such steps).
        for k, (layout, ids) in enumerate(zip(prog.inputs, inputs, strict=True)):
            leaves.append(_input(name, k, layout, {prog.device_of[int(c)]: buffers[int(b)]
                                                   for c, b in ids}))
        args, kwargs = tree_util.tree_unflatten(prog.in_treedef, leaves)
        try:
            result = prog.fun(*args, **kwargs)
        except MtcError:
            raise
        except Exception as e:
            log.error("host %d: %s raised:\n%s", self.host, name, traceback.format_exc())
            raise ColocatedCallError(f"{name} raised {type(e).__name__}: {e}") from e
        out_leaves, treedef = tree_util.tree_flatten(result)
        if treedef != prog.out_treedef:
            raise ColocatedCallError(f"{name} returned {treedef}, declared {prog.out_treedef}")
        outputs: list[list[list[int]]] = []
        data: list[np.ndarray] = []
        for k, (r, spec) in enumerate(zip(out_leaves, prog.out_specs, strict=True)):
            shards = _check(name, k, r, spec)
            ids = []
            for s in shards:
                ids.append([prog.id_of[s.device], len(data)])
                data.append(np.ascontiguousarray(np.asarray(s.data)).reshape(-1).view(np.uint8))
            outputs.append(ids)
        reply = transfer.pack_message(self.area, {"outputs": outputs, **self._slot_state()},
                                      data, replies)
        return reply, [*leaves, *out_leaves]


def _boot_of(report: Any) -> str | None:
    """The boot id of a controller's report of the reply slots it maps, checked."""
    if not isinstance(report, dict) or report.get("boot") is None:
        return None
    boot = report["boot"]
    if not isinstance(boot, str) or not _BOOT.fullmatch(boot):
        raise ProtocolError(f"malformed reply-slot report {boot!r}")
    return boot


def _nbytes(held: list[Any]) -> int:
    return sum(int(getattr(x, "nbytes", 0)) for x in held)


def _let_go(held: list[Any]) -> None:
    """Drop a call's arrays and have JAX release their host memory now (it does so
    in a transfer to each of their devices), not in the next call's first one."""
    import jax

    # This host's devices only: a program's arrays span the job's, the rest's
    # devices being another process's (no transfer to them from here).
    devices = {s.device for x in held if isinstance(x, jax.Array)
               for s in x.addressable_shards}
    held.clear()
    try:
        for d in devices:
            jax.device_put(np.zeros(1, np.uint8), d).block_until_ready()
    except Exception as e:  # noqa: BLE001 - the memory then goes at the next call
        log.debug("releasing a call's arrays: %r", e)


def _input(name: str, k: int, layout: ShardLayout, raw: dict[Any, np.ndarray]) -> Any:
    """Input ``k`` of a call, made from this host's shards of it (``raw``: its
    bytes by device), checked against its declared layout."""
    if raw.keys() != set(layout.devices):
        raise ProtocolError(f"{name}: input {k} came without this host's shards")
    for b in raw.values():
        if b.nbytes != layout.nbytes:
            raise ProtocolError(f"{name}: input {k}'s shard is {b.nbytes} bytes")
    return layout.array(raw)


def _check(name: str, k: int, r: Any, spec: Any) -> Sequence[Any]:
    """Output ``k`` against its declared spec, as the runtime holds it; its
    addressable shards (JAX makes them anew on every access)."""
    import jax

    if not isinstance(r, jax.Array):
        raise ColocatedCallError(f"{name}: output {k} is a {type(r).__name__}, not a jax.Array")
    if r.dtype != spec.dtype or r.shape != spec.shape:
        raise ColocatedCallError(f"{name}: output {k} is {r.dtype}{list(r.shape)}, declared "
                                 f"{spec.dtype}{list(spec.shape)}")
    shards = r.addressable_shards
    if not r.sharding.is_equivalent_to(spec.sharding, r.ndim) or (
            {s.device for s in shards} != set(spec.sharding.addressable_devices)):
        raise ColocatedCallError(f"{name}: output {k} is not on its declared sharding "
                                 f"{spec.sharding.spec} over this host's devices")
    return shards
