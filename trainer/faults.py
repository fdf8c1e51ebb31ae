"""Losing simulated hosts of a local cluster: real SIGKILLs of every process of a
host (its RAM disk goes with them), and their devices failed through
pathwaysutils' fault simulator. What a host holds is asked of its sidecar
(:meth:`LocalCluster.inspect`): this process never sees a RAM disk."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import jax
from pathwaysutils.test.mock_fault_injection import DeviceLossSimulator

from mtc.lifecycle import Threads
from mtc.testing.local_cluster import LocalCluster
from mtc.trainer.jsonlog import JsonLog


class SliceLossSimulator(DeviceLossSimulator):
    """``DeviceLossSimulator`` that copes with freed and donated arrays.

    The simulator keys arrays by ``id()``; CPython reuses the id of a freed
    array for a new one, which then inherited the old array's devices and
    "lost" state: healthy arrays on the surviving slice raised DATA_LOSS. Each
    id is checked against a weak reference to the array it was recorded for.
    Its patched ``jax.jit`` also asks the inputs for their devices after the
    call, which raises for donated (deleted) inputs.
    """

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, weakref.ref[Any]] = {}

    def _fresh(self, arr: Any) -> None:
        if not isinstance(arr, jax.Array) or isinstance(arr, jax.core.Tracer):
            return
        i = id(arr)
        ref = self._refs.get(i)
        if ref is not None and ref() is arr:
            return
        self._array_devices.pop(i, None)
        self._array_generation.pop(i, None)
        self._corrupted_array_ids.discard(i)
        try:
            self._refs[i] = weakref.ref(arr)
        except TypeError:
            self._refs.pop(i, None)

    def track_array(self, arr: Any) -> None:
        if _deleted(arr):
            return  # a donated input: its devices can no longer be asked
        self._fresh(arr)
        super().track_array(arr)

    def is_array_corrupted(self, arr: Any) -> bool:
        if _deleted(arr):
            return id(arr) in self._corrupted_array_ids
        self._fresh(arr)
        return bool(super().is_array_corrupted(arr))

    def bind_array_to_devices(self, arr: Any, devices: Sequence[jax.Device]) -> None:
        self._fresh(arr)
        super().bind_array_to_devices(arr, devices)

    def start(self) -> None:
        """Also: a shard taken from an array (``addressable_shards``) is that
        array's buffer on its device, so it shares the array's history. A device
        lost after the array was made and back since holds nothing of it (the
        simulator would otherwise date the shard from when it was taken)."""
        if self._active:
            return
        super().start()
        sim = self

        def shards_factory(orig: Any) -> property:
            def shards(arr: Any) -> Any:
                out = orig.fget(arr)
                if _deleted(arr):
                    return out
                sim._fresh(arr)  # not the history of a freed array with the same id
                gen = sim._array_generation.get(id(arr))
                if gen is not None:
                    for s in out:
                        sim.track_array(s.data)  # forgets a freed array's id first
                        sim._array_generation[id(s.data)] = min(
                            gen, sim._array_generation[id(s.data)])
                return out
            return property(shards)

        for cls in [jax.Array, *jax.Array.__subclasses__()]:
            if isinstance(cls.__dict__.get("addressable_shards"), property):
                self._patch(cls, "addressable_shards", shards_factory)


def _deleted(arr: Any) -> bool:
    return (isinstance(arr, jax.Array) and not isinstance(arr, jax.core.Tracer)
            and arr.is_deleted())


class HostFaults:
    """Loses hosts of a :class:`LocalCluster` and brings them back.

    A lost host's sidecar and replicator are SIGKILLed (its RAM disk is gone); its
    devices are marked lost in a :class:`SliceLossSimulator`, so arrays on them
    raise ``DATA_LOSS`` and pathwaysutils' health check reports the slice down.
    """

    def __init__(self, cluster: LocalCluster, devices: Sequence[jax.Device], log: JsonLog) -> None:
        self.cluster = cluster
        self.devices = list(devices)
        self.per_host = len(self.devices) // cluster.num_hosts
        self.log = log
        self.sim: SliceLossSimulator | None = None
        self.lost_slices: set[int] = set()
        self.returned_t: float | None = None  # when the last lost hosts were back
        # The returns of lost hosts (bring_back), joined by close().
        self.threads = Threads("host-faults")
        # Guards lost_slices, replacing and returns; notified when hosts are back.
        self.changed = threading.Condition()
        self.replacing: set[int] = set()  # slices whose hosts are being replaced
        self.returns = 0  # how many times lost hosts came back

    def devices_of(self, host: int) -> list[jax.Device]:
        return self.devices[host * self.per_host:(host + 1) * self.per_host]

    def lose(self, hosts: list[int], slice_: int) -> None:
        for h in hosts:
            self.cluster.lose_host(h)  # SIGKILL its processes: the RAM disk goes too
        if self.sim is None:
            self.sim = SliceLossSimulator()
            self.sim.start()
        for h in hosts:
            for d in self.devices_of(h):
                self.sim.mark_device_lost(d)
        with self.changed:
            self.lost_slices.add(slice_)

    def lose_host_after_save(self, h: int, step: int, when: str, return_s: float
                             ) -> tuple[float, dict[str, Any]]:
        """Lose host ``h`` once its save of ``step`` is on its peer (``when``
        "replicated") or while its writer writes it ("mid-save"); it comes back,
        empty, ``return_s`` later. Returns when it was lost and what was seen."""
        s = h // self.cluster.hosts_per_slice
        if when == "replicated":
            waited = self.wait_on_peer(h, step)  # the restore shows the peer tier
        else:
            waited = self.wait_writing(h, step)  # not yet committed
        seen = self.cluster.inspect(h) or {"writing": [], "committed": []}
        in_flight, committed = step in seen["writing"], step in seen["committed"]
        t = time.time()
        self.will_replace(s)
        self.lose([h], s)
        detail = {"host": h, "slice": s, "save_step": step, "when": when,
                  "save_committed_on_host_at_loss": committed,
                  "save_in_flight_on_host_at_loss": bool(in_flight),
                  # After the SIGKILL: a copy the dead sender had not committed never is.
                  "save_on_peer_at_loss": self.peer_copy(h, step),
                  "seconds_waited_before_loss": waited}
        self.bring_back([h], s, return_s)
        return t, detail

    def will_replace(self, slice_: int) -> None:
        """Say, before a loss, that the slice's hosts will be replaced: a trainer that
        notices the loss at once must already see the replacement on its way (it
        would resize instead of pausing for it)."""
        with self.changed:
            self.replacing.add(slice_)

    def bring_back(self, hosts: list[int], slice_: int, delay: float) -> None:
        """After ``delay`` seconds, in the background: new replicators over empty
        RAM disks, then the devices healthy again. From now until then the slice
        counts as being replaced (:meth:`replacing_slices`); waiters on
        :meth:`wait_back` are woken the moment it is back."""
        with self.changed:
            self.replacing.add(slice_)

        def run() -> None:
            time.sleep(delay)  # the replacement's own start (simulated)
            self.cluster.start_hosts(hosts)
            sim = self.sim
            if sim is not None:
                for h in hosts:
                    for d in self.devices_of(h):
                        sim.mark_device_connected(d)
            with self.changed:
                self.lost_slices.discard(slice_)
                self.replacing.discard(slice_)
                self.returned_t = time.time()
                self.returns += 1
                self.changed.notify_all()
            self.log.write(event="returned", hosts=hosts, slice=slice_)

        # A daemon: a trainer that fails exits without waiting for its hosts to return.
        self.threads.start(run, "host-return", daemon=True)

    def close(self, timeout: float | None = None) -> bool:
        """Wait for the hosts on their way back (:meth:`bring_back`); whether they all
        returned within ``timeout``. A return that failed raises its error."""
        return self.threads.join(timeout)

    def replacing_slices(self) -> set[int]:
        with self.changed:
            return set(self.replacing)

    def wait_back(self, slices: set[int], timeout: float) -> bool:
        """Wait (woken by the return, no polling) until none of ``slices`` is lost;
        False after ``timeout`` seconds."""
        with self.changed:
            return self.changed.wait_for(lambda: not (self.lost_slices & slices), timeout)

    def stop_if_healthy(self) -> None:
        """Stop simulating once nothing is lost (the simulator patches JAX)."""
        if not self.lost_slices and self.sim is not None:
            self.sim.stop()
            self.sim = None

    def peer_copy(self, host: int, step: int) -> bool:
        """Whether another host holds a committed copy of ``host``'s files of ``step``."""
        for p in range(self.cluster.num_hosts):
            seen = self.cluster.inspect(p) if p != host else None
            if seen is not None and step in seen["replicas"].get(str(host), []):
                return True
        return False

    def wait_on_peer(self, host: int, step: int, timeout: float = 30.0) -> float:
        """Seconds waited until ``host``'s save of ``step`` is on its peer."""
        t0 = time.perf_counter()
        while not self.peer_copy(host, step) and time.perf_counter() - t0 < timeout:
            time.sleep(0.02)
        return time.perf_counter() - t0

    def wait_writing(self, host: int, step: int, timeout: float = 5.0) -> float:
        """Seconds waited until ``host``'s writer has opened ``step``'s temporary
        folder (or committed it already)."""
        t0 = time.perf_counter()
        for _ in range(100_000):  # bounded in count as in time; a request is ~1 ms
            seen = self.cluster.inspect(host)
            if seen is not None and (step in seen["writing"] or step in seen["committed"]):
                break
            if time.perf_counter() - t0 > timeout:
                break
        return time.perf_counter() - t0
