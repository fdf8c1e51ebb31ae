"""Host-side code through ``jax.experimental.colocated_python`` (Pathways): the
colocated-Python sidecar of each worker runs it; on the local cluster, each
host's sidecar process does (:mod:`mtc.dispatch.remote_colocated`).

A fixed handful of calls, whatever the host count: a save is one call that polls
and lists every host's steps, and one that stages (its answer read at the next
call, as a background error is); a restore is one call for every host's steps
and manifests (two when the manifests outgrow a small answer) and one that
loads. Small answers have a fixed size, on one CPU device per worker. A restore
returns arrays on the workers' own CPU devices (:mod:`.colocated_load`): no
restored byte passes through this process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mtc.contract import AgentConfig, LeafSpec, ReadTask, SaveHeader
from mtc.dispatch import colocated_load
from mtc.dispatch.calls import POLL_INTERVAL_S as POLL_INTERVAL_S  # its name here too
from mtc.dispatch.calls import HostCalls, poll_due, regions_of
from mtc.dispatch.colocated_answers import Answers
from mtc.dispatch.colocated_moves import colocated_cpu, to_workers
from mtc.dispatch.process import Sidecar
from mtc.dispatch.protocol import BeforeSend, Opened, Survey
from mtc.dispatch.remote_colocated import Held, Runtime, holding, host_views
from mtc.errors import MtcError
from mtc.operations import (
    POLL,
    READ,
    RETAIN,
    STAGE,
    SURVEY,
    WAIT,
    Operation,
    ReadRequest,
    Request,
    RetainRequest,
    SurveyRequest,
)
from mtc.pool import ThreadPool
from mtc.save.device_copy import DeviceCopier, on_accelerator

# Load functions kept specialized, by their outputs' specs (restores of one state's
# shape reuse one; a resized mesh or another tree makes another).
LOAD_CALLS_KEPT = 8
# A restore onto an accelerator loads in calls that shrink towards the end, the last
# about this many bytes, at most MAX_LOAD_CALLS of them (colocated_load.call_groups).
LOAD_CALL_BYTES = 256 << 20
MAX_LOAD_CALLS = 6


class ColocatedDispatch(HostCalls):
    """Host-side code runs through ``jax.experimental.colocated_python`` (Pathways).

    Workers take no writer lock: a JobSet runs one controller, and a sidecar that
    outlived a crashed controller would keep its successor out. Not thread-safe:
    the manager's thread. ``calls`` counts the colocated calls made, and
    ``answers.read_bytes`` the bytes of host answers read here (never a restored
    array's)."""

    host_side_lock = False

    def __init__(self, config: AgentConfig, devices: Sequence[jax.Device],
                 sidecars: dict[int, Sidecar] | None = None, *,
                 copier: DeviceCopier | None = None) -> None:

        from mtc.sidecar.colocated import ANSWER_BYTES, RemoteAgent, install_cpu_id_patch

        install_cpu_id_patch()

        self.config = config
        self.calls = 0
        # The colocated CPU devices of ``devices``, in their order; each worker learns
        # which host it is from its own element of ``_ranks`` (ids of the
        # controller's devices mean nothing on a worker).
        cpu = colocated_cpu(devices)
        rank_of: dict[Any, int] = {}
        self._cpu_of: dict[int, jax.Device] = {}
        for d, c in zip(devices, cpu, strict=True):
            rank_of.setdefault(c, config.host_of_device[d.id])
            self._cpu_of[d.id] = c
        self.cpu_devices = list(rank_of)
        self._rank_of = rank_of
        mesh = jax.sharding.Mesh(np.array(self.cpu_devices), ("hosts",))
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._per_host = NamedSharding(mesh, PartitionSpec("hosts"))
        self._ranks = self._ranks_on(self.cpu_devices)
        # Requests and small answers: one CPU device per worker.
        first: dict[int, Any] = {}
        for c in self.cpu_devices:
            first.setdefault(rank_of[c], c)
        self._workers = [first[r] for r in sorted(first)]
        small = jax.sharding.Mesh(np.array(self._workers), ("hosts",))
        self._small_replicated = NamedSharding(small, PartitionSpec())
        self._small_per_host = NamedSharding(small, PartitionSpec("hosts"))
        self._small_ranks = self._ranks_on(self._workers)
        # On the local cluster, the hosts' sidecars run the programs (as workers
        # do), instead of JAX's CPU fallback in this process.
        self._host_of_cpu = {c.id: r for c, r in rank_of.items()}
        self._runtime = (Runtime(sidecars, self._host_of_cpu) if sidecars is not None
                         else None)
        remote: Any = RemoteAgent(config.to_json())  # type: ignore[call-arg]
        # Specialized with their output specs, so that the first call does not
        # run synchronously to infer them.
        staged = jax.ShapeDtypeStruct((len(self.cpu_devices),), np.dtype(np.uint8),
                                      sharding=self._per_host)
        answer = jax.ShapeDtypeStruct((len(self._workers),), np.dtype(np.uint8),
                                      sharding=self._small_per_host)
        self._stage = remote.stage.specialize(out_specs_fn=lambda *_: staged)
        self._wait = remote.wait.specialize(out_specs_fn=lambda *_: answer)
        self._poll = remote.poll.specialize(out_specs_fn=lambda *_: answer)
        self._close = remote.close.specialize(out_specs_fn=lambda *_: answer)
        self._remote = remote
        self.answers = Answers(remote, self._small_ranks, rank_of, self._invoke)
        # A restore's survey, which brings the manifests, asks for an answer sized
        # by them (the open's answer and every listing say how long the newest
        # are), so that they come in its one call.
        self._survey_size = ANSWER_BYTES
        self._loaders: dict[tuple[jax.ShapeDtypeStruct, ...], Any] = {}
        # The last save's stage answer, read at the next call (or at once for a
        # save that may be skipped); whether a save was staged since the last wait.
        self._staged: jax.Array | Future[jax.Array] | None = None
        # The arrays the last save handed the workers: kept alive until they
        # answered that they took them (Pathways does not keep them for us).
        self._staged_inputs: list[jax.Array] = []
        self._pinned: Held = {}
        self._unwaited = False
        self._polled = 0.0
        # A poll between saves, made in the background (check_before_save).
        self._polling: jax.Array | Future[jax.Array] | None = None
        # On the local cluster a stage call runs on this thread of its own, as a
        # Pathways call returns before the workers answer (the save's stall is the
        # dispatch, not the hosts' work); the next call waits for it first.
        # So does a stage of arrays on an accelerator where JAX runs colocated Python
        # in this process (its fallback runs the call in the caller's thread, which
        # would hold the step for the device-to-host copy Pathways does behind it).
        on_device = any(d.platform != "cpu" for d in devices)
        self._async = (ThreadPool(1, "mtc-colocated-stage")
                       if sidecars is not None or on_device else None)
        self.copier = copier or DeviceCopier(None)
        self.load_call_bytes: int | None = LOAD_CALL_BYTES if on_device else None
        # While a save lists the hosts: retention requests ride on its stage call.
        self._saving: Survey | None = None
        self._before_stage: list[dict[str, Any]] = []

    def _ranks_on(self, devices: Sequence[Any]) -> jax.Array:
        sharding = NamedSharding(jax.sharding.Mesh(np.array(devices), ("hosts",)),
                                 PartitionSpec("hosts"))
        return jax.make_array_from_single_device_arrays(
            (len(devices),), sharding,
            [jax.device_put(np.array([self._rank_of[c]], np.int32), c) for c in devices])

    def _invoke(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.calls += 1
        return self._on_runtime(fn, *args)

    def _invoke_later(self, fn: Callable[..., Any], *args: Any,
                      held: Held | None = None) -> Future[Any]:
        """``fn(*args)`` on the local cluster's call thread (a Pathways call returns
        before the workers answer), after any call made there before it; ``held``:
        the inputs' host views, taken now."""
        assert self._async is not None
        self.calls += 1
        return self._async.submit(self._on_runtime, fn, *args, held=held)

    def _on_runtime(self, fn: Callable[..., Any], *args: Any,
                    held: Held | None = None) -> Any:
        """``fn(*args)``, a program JAX compiles for it going to this dispatcher's
        hosts (another manager's, over the same CPU devices, may be open)."""
        if self._runtime is None:
            return fn(*args)
        with self._runtime.serving(), holding(held):
            return fn(*args)

    # -- host requests ----------------------------------------------------------------

    def _call(self, op: Operation[Any, Any], hosts: Sequence[int], request: Request
              ) -> list[Any]:
        """The request goes to every worker; each answers for its own host (null
        when not asked about it)."""
        self._collect()
        manifests = isinstance(request, SurveyRequest) and request.manifest
        replies = self.answers.exchange(op.encode(hosts, request),
                                        self._survey_size if manifests else None)
        # Every survey (a save's listing too) says how long the newest manifests
        # are now: the next restore's survey brings them in its one call.
        if op is SURVEY:
            sizes = [int(got.get("manifest_bytes") or 0)
                     for reply in replies for got in (reply or {}).values()]
            if any(sizes):
                self._survey_size = answer_size_for(max(sizes))
        return replies

    def open(self, hosts: Sequence[int], *, read_only: bool,
             identify: bool = False, metadata: str | None = None) -> dict[int, Opened]:
        """:meth:`HostCalls.open`; a restore's survey then asks for an answer that
        holds the newest step's manifest (:func:`answer_size_for`)."""
        opened = super().open(hosts, read_only=read_only, identify=identify,
                              metadata=metadata)
        longest = max((o.manifest_bytes for o in opened.values()), default=0)
        self._survey_size = answer_size_for(longest)
        return opened

    # -- save -------------------------------------------------------------------------

    def _collect(self) -> None:
        """The last save's stage answer, and the answer of a poll in flight: a
        worker's refusal is raised here, on the call after the save, as a
        background write's error would be. Every call to the workers comes after
        this, so calls to one host never overlap."""
        staged, self._staged = self._staged, None
        polling, self._polling = self._polling, None
        try:
            if isinstance(staged, Future):
                staged = staged.result()
            if staged is not None:
                self.answers.unanimous(staged, STAGE.name)
        finally:
            self._staged_inputs, self._pinned = [], {}
            if isinstance(polling, Future):  # no call overlaps it, whatever was raised
                futures.wait([polling])
        if isinstance(polling, Future):
            polling = polling.result()
        if polling is not None:
            self.answers.unanimous(polling, POLL.name)

    def check_before_save(self, due: bool) -> None:
        """A save that follows polls in its first call. Off the interval, a save in
        flight is polled at most every POLL_INTERVAL_S, in the background: the
        poll's answer is read at the first check after it came (or the next call),
        so a training step never waits for the hosts' round trip."""
        if due or not self._unwaited:
            return
        polling = self._polling
        if polling is not None:
            done = (polling.done() if isinstance(polling, Future)
                    else polling.is_ready())  # type: ignore[attr-defined]
            if not done:
                return
            self._collect()  # raises a background error the hosts reported
        if not poll_due(self._unwaited, self._polled, time.monotonic()):
            return
        # A Pathways call returns at once (its answer comes later); the local cluster's
        # goes behind a stage in flight, on the same thread: a host's calls stay in order.
        invoke = self._invoke if self._async is None else self._invoke_later
        self._polling = invoke(self._poll_from_now, self._small_ranks)

    def _poll_from_now(self, ranks: Any) -> Any:
        """A poll between saves; the interval counts from its start, which may wait
        behind a stage on the call thread."""
        self._polled = time.monotonic()
        return self._poll(ranks)

    def save(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray],
             hosts: Sequence[int], before_send: BeforeSend) -> bool:
        survey = self.survey(hosts, None, manifests=False)  # polls the workers too
        self._polled = time.monotonic()
        self._saving, self._before_stage = survey, []
        try:
            before_send(survey)
            return self._send(header, arrays, self._before_stage)
        finally:
            self._saving, self._before_stage = None, []

    def retain(self, hosts: Sequence[int], complete: Sequence[int], *, max_to_keep: int | None,
               keep_period: int | None, before_write: bool) -> dict[int, tuple[int, int]]:
        if self._saving is None or not before_write:
            return super().retain(hosts, complete, max_to_keep=max_to_keep,
                                  keep_period=keep_period, before_write=before_write)
        # Within a save: done by the workers as the save's stage call begins, and
        # answered with the space they reported when the save listed their steps.
        self._before_stage.append(json.loads(RETAIN.encode(hosts, RetainRequest(
            list(complete), max_to_keep, keep_period, before_write))))
        return {h: self._saving.space[h] for h in hosts if h in self._saving.space}

    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray]) -> bool:
        self._collect()
        return self._send(header, arrays, [])

    def _send(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray],
              before: list[dict[str, Any]]) -> bool:
        header_arr = jax.device_put(np.frombuffer(header.to_bytes(), np.uint8), self._replicated)
        requests = jax.device_put(np.frombuffer(json.dumps(before).encode(), np.uint8),
                                  self._replicated)
        # On an accelerator: a copy in device memory (the previous save's stage,
        # which read the last one, was collected before this save listed the
        # hosts), which the transfer to the workers' CPU devices reads while the
        # next steps run; a step donating the state waits for the copy only.
        # What does not fit the device-memory budget moves onto the workers' CPU
        # devices now, from the state itself (the step waits for it); the copies
        # move on the call thread.
        copied = self.copier.copy(arrays)
        self._unwaited = True
        if copied is not None and self._async is not None and not header.skip_if_busy:
            mixed = [a if i in copied.owned else self._to_cpu(a)
                     for i, a in enumerate(copied.arrays)]
            jax.block_until_ready([m for i, m in enumerate(mixed) if i not in copied.owned
                                   and isinstance(m, jax.Array)])
            self._staged = self._invoke_later(self._stage_copies, header_arr, requests, mixed)
            return True
        inputs = [self._to_cpu(a) for a in (arrays if copied is None else copied.arrays)]
        del copied  # the transfers hold what they read
        if self._async is None or header.skip_if_busy:
            ok = self._invoke(self._stage, header_arr, self._ranks, inputs, requests)
            if header.skip_if_busy:  # whether it was skipped is the save's answer
                return self.answers.unanimous(ok, STAGE.name)
            self._staged, self._staged_inputs = ok, inputs
            return True
        # The values of this moment: a host view of every shard (CPU devices: no
        # copy), which a step that donates the state's buffers does not change, and
        # which the call reads (jax 0.12.1 marks a donated array deleted all the same).
        # Inputs moved here from an accelerator are new buffers of this save's own:
        # nothing to hold (a view would wait for their transfer here).
        moved = any(on_accelerator(a) for a in arrays)
        self._pinned = {} if moved else host_views(STAGE.name, inputs, self._host_of_cpu)
        self._staged = self._invoke_later(self._stage, header_arr, self._ranks, inputs,
                                          requests, held=self._pinned)
        self._staged_inputs = inputs
        return True

    def _stage_copies(self, header: jax.Array, requests: jax.Array,
                      copies: list[jax.Array | np.ndarray]) -> Any:
        """The stage call of a save's copies in device memory, on the call thread:
        their move onto the workers' CPU devices runs here, not in the step's way,
        one array at a time (a transfer of them all at once slowed the steps
        meanwhile: on a TPU v5e a 4 GiB state's next step took 0.64 s, not 0.08).
        The inputs stay referenced until the workers answered (collected)."""
        inputs = []
        for c in copies:
            inputs.append(self._to_cpu(c))
            if isinstance(c, jax.Array) and on_accelerator(c):
                jax.block_until_ready(inputs[-1])
        del copies
        self._staged_inputs = inputs
        return self._stage(header, self._ranks, inputs, requests)

    def _to_cpu(self, x: jax.Array | np.ndarray) -> jax.Array:
        return to_workers(x, self.cpu_devices, self._replicated)

    def wait(self) -> None:
        self._collect()
        if not self._unwaited:
            return  # nothing staged since the last wait: nothing to wait for
        self.answers.unanimous(self._invoke(self._wait, self._small_ranks), WAIT.name)
        self._unwaited = False

    def raise_background_error(self) -> None:
        self._collect()
        self._polled = time.monotonic()
        self.answers.unanimous(self._invoke(self._poll, self._small_ranks), POLL.name)

    def saves_in_flight(self, hosts: Sequence[int]) -> int:
        return 1 if self._unwaited else 0

    # -- restore ----------------------------------------------------------------------

    def _fetch(self, step: int, by_host: dict[int, list[ReadTask]]
               ) -> dict[int, list[np.ndarray]]:
        """Regions as numpy, for leaves the caller asked to get as numpy: one request
        to every worker, each reading its own host's tasks."""
        replies = dict(zip(sorted(set(self._rank_of.values())), self.ask(
            READ, sorted(by_host), ReadRequest(step, by_host)), strict=True))
        return {h: regions_of(ts, replies[h]) for h, ts in by_host.items()}

    def load(self, step: int, tasks: Sequence[ReadTask],
             specs: dict[int, LeafSpec]) -> dict[int, jax.Array]:
        """A call per group of leaves (:func:`colocated_load.call_groups`): every
        worker returns its regions as arrays on its own CPU devices, which
        ``device_put`` moves onto the target shardings (on the call thread, where
        there is one, while the next group's call reads)."""
        if not colocated_load.supported(specs):
            return super().load(step, tasks, specs)
        self._collect()
        moved: list[Future[dict[int, jax.Array]]] = []
        try:
            for leaves in colocated_load.call_groups(specs, self.load_call_bytes,
                                                     MAX_LOAD_CALLS):
                group = {leaf: specs[leaf] for leaf in leaves}
                plan, outputs = self._load_group(
                    step, [t for t in tasks if t.leaf in group], group)
                if self._async is None:
                    moved.append(futures.Future())
                    moved[-1].set_result(colocated_load.finish(plan, outputs, group))
                else:
                    moved.append(self._async.submit(colocated_load.finish, plan, outputs,
                                                    group))
        finally:
            futures.wait(moved)  # none left moving behind an error
        return {leaf: a for m in moved for leaf, a in m.result().items()}

    def _load_group(self, step: int, tasks: Sequence[ReadTask], specs: dict[int, LeafSpec]
                    ) -> tuple[colocated_load.LoadPlan, list[jax.Array]]:
        plan = colocated_load.plan(step, tasks, specs, self.config.host_of_device,
                                   self._cpu_of, self.cpu_devices, self._rank_of)
        call = self._load_call(plan.out_specs)
        # Each worker gets its own part of the plan, on each of its CPU devices.
        size, parts = colocated_load.encode(plan, sorted(set(self._rank_of.values())))
        request = jax.make_array_from_single_device_arrays(
            (size * len(self.cpu_devices),), self._per_host,
            jax.device_put([parts[self._rank_of[c]] for c in self.cpu_devices],
                           self.cpu_devices))
        try:
            return plan, list(self._invoke(call, request, self._ranks))
        except MtcError:
            raise
        except Exception as e:  # a worker's error reaches a real controller untyped
            self.answers.raise_worker_error(f"load: {e}")
            raise

    def _load_call(self, out_specs: list[jax.ShapeDtypeStruct]) -> Any:
        """The load function specialized for ``out_specs``, kept per specs: a new one
        per restore would be pickled, sent and loaded by every worker again."""
        key = tuple(out_specs)
        call = self._loaders.pop(key, None)
        if call is None:
            call = self._remote.load.specialize(out_specs_fn=lambda *_: out_specs)
        self._loaders[key] = call  # the newest last
        while len(self._loaders) > LOAD_CALLS_KEPT:
            del self._loaders[next(iter(self._loaders))]
        return call

    def close(self) -> None:
        """Every save finished, the workers' objects closed (their writer threads
        joined), and on the local cluster the hosts told to drop this manager's
        programs."""
        try:
            self.wait()
            self.answers.unanimous(self._invoke(self._close, self._small_ranks), "close")
        finally:
            if self._async is not None:
                self._async.shutdown(wait=True)
            if self._runtime is not None:
                self._runtime.close()


def answer_size_for(manifest_bytes: int) -> int:
    """The fixed-size answer (a power of two, ANSWER_BYTES to MAX_ANSWER_BYTES) that
    holds a survey's reply carrying a manifest of ``manifest_bytes``, quoted once
    more inside the reply, beside the host's steps, their facts and its space."""
    from mtc.sidecar.colocated import ANSWER_BYTES, MAX_ANSWER_BYTES

    need = manifest_bytes * 3 // 2 + 4096
    return max(ANSWER_BYTES, min(MAX_ANSWER_BYTES, 1 << (need - 1).bit_length()))

