"""A local cluster for restore-after-failure tests: hosts as real processes, faults as calls.

:class:`TestCluster` is :class:`mtc.testing.local_cluster.LocalCluster` (the cluster
``mtc-cluster up`` starts, and the demos run on) with the calls a test needs:
``options()`` for the test's own ``CheckpointManager``, faults (SIGKILLs, an
emptied RAM disk, a partition) and waits on what the replicators report. Every
host is its own sidecar and replicator; the test's process reaches a host only
through them (its RAM disk is the host's alone: a private tmpfs with root,
else a folder only the host's processes use).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtc.errors import ConfigError
from mtc.testing import replicas
from mtc.testing.local_cluster import LocalCluster, default_base

if TYPE_CHECKING:
    import mtc

LOG_TAIL_CHARS = 3000  # of each host's logs, printed when a test fails on the cluster


class ScriptError(subprocess.CalledProcessError):
    """A training script :meth:`TestCluster.run_script` ran failed: the message ends
    with its output's end. ``note``: what failed, in words, first in the message (a
    job's first failed process, its host and exit status)."""

    def __init__(self, returncode: int, cmd: Any, output: str | None = None,
                 stderr: str | None = None, note: str = "",
                 tail_chars: int = LOG_TAIL_CHARS) -> None:
        super().__init__(returncode, cmd, output, stderr)
        self.note = note
        # How much of stderr the message shows: a job's holds each process's own
        # tail, already cut, the failed process's first, all of it shown.
        self.tail_chars = tail_chars

    def __str__(self) -> str:
        head = f"{self.note}\n" if self.note else ""
        return (f"{head}{super().__str__()}"
                f"\n--- stdout ---\n{(self.stdout or '')[-LOG_TAIL_CHARS:]}"
                f"\n--- stderr ---\n{(self.stderr or '')[-self.tail_chars:]}")


class TestCluster:
    """``slices`` x ``hosts_per_slice`` hosts, each a sidecar and a replicator; the
    replicators keep one peer copy of each host's steps in another slice and back up
    to ``backup`` (default a folder of the cluster's own).

    Hosts are numbered ``0 .. num_hosts - 1``, slice by slice (host ``h`` is in
    slice ``h // hosts_per_slice``), as :meth:`options` numbers them for mtc."""

    __test__ = False  # a class named Test*: not a pytest test class

    def __init__(self, local: LocalCluster) -> None:
        self.local = local
        # A running job's process per host (run_job's): a lost host takes it along,
        # as a machine that dies takes its training process. And the hosts lost
        # while one ran, which its error names as the cause.
        self._job_processes: dict[int, subprocess.Popen[str]] = {}
        self._lost_in_job: set[int] = set()

    def job_started(self, host: int, process: subprocess.Popen[str]) -> None:
        """``process`` is a job's process on ``host`` (:meth:`run_job`'s) until
        :meth:`job_ended`; :meth:`kill_host` of ``host`` SIGKILLs it."""
        self._job_processes[host] = process
        self._lost_in_job.discard(host)

    def job_ended(self, host: int) -> None:
        self._job_processes.pop(host, None)

    def lost_during_job(self, host: int) -> bool:
        """Whether ``host`` was lost while a job's process ran on it."""
        return host in self._lost_in_job

    @classmethod
    def up(cls, *, slices: int = 2, hosts_per_slice: int = 2, base: Path | None = None,
           backup: str | None = None, backup_every_steps: int | None = None) -> TestCluster:
        """Start every host and wait until each serves. ``backup``: a URL
        (``file://``, ``gs://`` with ``STORAGE_EMULATOR_HOST``) or ``"gcs-emulator"``
        (needs ``mtc[dev]``: a fake-gcs-server of the cluster's own);
        ``backup_every_steps``: the replicators back up every that many steps
        (default: only when asked, :meth:`request_backup`)."""
        base = base or default_base(f"testing-{uuid.uuid4().hex[:8]}")
        return cls(LocalCluster.up(base, slices=slices, hosts_per_slice=hosts_per_slice,
                                   backup=backup, backup_every_steps=backup_every_steps))

    @classmethod
    def from_env(cls) -> TestCluster:
        """In a script :meth:`run_script` started: the cluster that runs it (its
        ``local_dir``, ``options()``, waits and faults)."""
        base = os.environ.get("MTC_TESTING_CLUSTER")
        if not base:
            raise RuntimeError("MTC_TESTING_CLUSTER is not set: run the script with "
                               "TestCluster.run_script")
        return cls(LocalCluster.load(Path(base)))

    def down(self) -> None:
        """SIGKILL every process of every host; remove the namespaces and the folders."""
        self.local.down_latest()

    # -- what a test's CheckpointManager needs ------------------------------------------

    @property
    def slices(self) -> int:
        return self.local.slices

    @property
    def hosts_per_slice(self) -> int:
        return self.local.hosts_per_slice

    @property
    def num_hosts(self) -> int:
        return self.local.num_hosts

    @property
    def local_dir(self) -> Path:
        """The ``CheckpointManager``'s directory: each host's steps are on its own RAM
        disk, reached through its sidecar, so this folder of the test's stays empty."""
        path = self.local.base / "controller"
        path.mkdir(exist_ok=True)
        return path

    def options(self, **kw: Any) -> mtc.Options:
        """``mtc.Options`` of a controller of every host: ``kw`` as a training job's
        (``save_interval_steps=10``, ...), plus the hosts' sidecars, the replicators
        and their token. The job's devices are grouped into :attr:`num_hosts` hosts."""
        import mtc  # here: starting a cluster needs no JAX

        return mtc.Options(**{
            "simulated_hosts": self.num_hosts, "hosts_per_slice": self.hosts_per_slice,
            "sidecars": self.local.sidecars(), "replicators": tuple(self.local.addresses),
            "replicator_token": self.local.token(), **kw})

    def script_env(self) -> dict[str, str]:
        """The environment a training script run on this cluster gets
        (:meth:`run_script`): ``MTC_TESTING_CLUSTER``, which :meth:`from_env` reads."""
        return {**self.local.env(), "MTC_TESTING_CLUSTER": str(self.local.base)}

    # -- faults ---------------------------------------------------------------------

    def host(self, host: int) -> int:
        """``host``, checked: an index of this cluster's hosts (a ConfigError naming
        the valid range otherwise: ``-1`` is no host, not the last)."""
        if not _is_index(host, self.num_hosts):
            raise ConfigError(f"host {host!r}: this cluster's hosts are 0 .. "
                              f"{self.num_hosts - 1}")
        return int(host)

    def kill_host(self, host: int) -> None:
        """The host is lost: its sidecar and replicator SIGKILLed, its RAM disk gone
        with them. It stays down until :meth:`restart_host`."""
        host = self.host(host)
        if (p := self._job_processes.get(host)) is not None and p.poll() is None:
            self._lost_in_job.add(host)
            p.kill()
        self.local.lose_host(host)

    def lose_slice(self, slice_: int) -> None:
        """Every host of slice ``slice_`` is lost (:meth:`kill_host`)."""
        if not _is_index(slice_, self.slices):
            raise ConfigError(f"slice {slice_!r}: this cluster's slices are 0 .. "
                              f"{self.slices - 1}")
        for h in self.local.hosts_of_slice(slice_):
            self.kill_host(h)

    def wipe_ram_disk(self, *hosts: int) -> None:
        """The hosts' machines restart: their processes SIGKILLed and their RAM disks
        gone, all of them before any comes back, then each serves again at its
        address, empty (a replaced node). Returns when they serve."""
        hosts = tuple(self.host(h) for h in hosts)
        for h in hosts:
            self.kill_host(h)
        self._start_empty(list(hosts))

    def _start_empty(self, hosts: list[int]) -> None:
        for h in hosts:
            self.local.root(h).mkdir(parents=True, exist_ok=True)  # without namespaces
        self.local.start_hosts(hosts)

    def restart_host(self, host: int) -> None:
        """Start the host's processes again and wait until they serve. A host that
        is down (:meth:`kill_host`) comes back empty. A running host's sidecar and
        replicator are SIGKILLed and restarted one after the other, so its RAM disk
        stays, as a pod's memory volume outlives its containers."""
        host = self.host(host)
        h = self.local.hosts.hosts[host]
        if h.sidecar_pid is None and h.replicator_pid is None:
            self._start_empty([host])
            return
        self.local.hosts.kill_sidecar(host)  # the replicator keeps the RAM disk meanwhile
        self.local.start_sidecar(host)
        self.kill_replicator(host)  # the new sidecar keeps it now
        self.start_replicator(host)

    def kill_replicator(self, host: int) -> None:
        """SIGKILL the host's replicator alone (its sidecar keeps the RAM disk)."""
        host = self.host(host)
        self.local.kill(host)
        self.local.save()

    def start_replicator(self, host: int) -> None:
        """Start the host's replicator again (after :meth:`kill_replicator`) and wait
        until it serves."""
        host = self.host(host)
        self.local.launch(host)
        self.local.wait_serving(host)

    def partition(self, *groups: Sequence[int]) -> None:
        """Hosts reach only the hosts of their own group (a host in no group reaches
        every host); this process still reaches every host. Needs root (network
        namespaces): a RuntimeError otherwise. :meth:`heal` undoes it."""
        seen: set[int] = set()
        for group in groups:
            for h in group:
                if self.host(h) in seen:
                    raise ConfigError(f"host {h} is in two groups of the partition {groups}")
                seen.add(h)
        self.local.hosts.partition(groups)

    def heal(self) -> None:
        """Undo every :meth:`partition`."""
        self.local.hosts.heal()

    # -- waits on what the replicators report -----------------------------------------

    @property
    def replicators(self) -> replicas.HostReplicators:
        """The hosts' replicators as the harness's waits see them
        (:class:`mtc.testing.replicas.HostReplicators`: ``wait_held``,
        ``wait_replicated``, ``wait_passes``...), the waits the tests of mtc itself
        use on their clusters."""
        return replicas.HostReplicators(self.local.hosts, self.local.addresses,
                                        self.hosts_per_slice)

    def wait_replicated(self, step: int, timeout: float = 60.0) -> None:
        """Until every host's data of ``step`` is held by its peer, the host of the
        next slice with its in-slice index (a TimeoutError naming the hosts whose
        copy is missing after ``timeout``)."""
        step = _step(step)  # refused before any host is asked
        self.replicators.wait_replicated(step, timeout)

    def wait_backed_up(self, step: int, timeout: float = 60.0) -> None:
        """Until ``step`` is complete in the backup (every host's data and the commit
        marker, as the replicators list it)."""
        replicas.wait_backed_up(self.backed_up, _step(step), timeout)

    def request_backup(self) -> int:
        """Back up the newest step every host holds, now (as ``mtc backup``); returns
        that step (-1: none)."""
        return replicas.request_backup(self.local.addresses[0], self.local.token())

    def held(self) -> dict[int, set[tuple[int, int]]]:
        """Per running host, the (origin host, step) copies its replicator holds."""
        return {h: got for h in range(self.num_hosts)
                if (got := self._ask(h)) is not None}

    def _ask(self, host: int) -> set[tuple[int, int]] | None:
        if not self.local.alive(host):
            return None
        return replicas.held(self.local.addresses[host], host, self.local.token())

    def backed_up(self) -> list[int]:
        """The steps complete in the backup, as a running replicator lists them."""
        for h in range(self.num_hosts):
            if self.local.alive(h):
                return replicas.backed_up(self.local.addresses[h], h, self.local.token())
        return []

    # -- a training script ------------------------------------------------------------

    def run_script(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                   timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        """Run ``python argv...`` (a training script) as a controller of this cluster,
        with :meth:`script_env` and ``env``; its output captured. A script that exits
        non-zero raises ``subprocess.CalledProcessError`` whose message carries the
        end of its output."""
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                              timeout=timeout, env={**self.script_env(), **(env or {})},
                              check=False)
        if proc.returncode != 0:
            raise ScriptError(proc.returncode, [sys.executable, *argv], proc.stdout,
                              proc.stderr)
        return proc

    def run_job(self, argv: Sequence[str], *, hosts: Sequence[int] | None = None,
                devices_per_process: int = 2, env: Mapping[str, str] | None = None,
                reference: Path | None = None,
                timeout: float = 300.0) -> list[subprocess.CompletedProcess[str]]:
        """A multi-controller job: ``python argv...`` once per host, inside it
        (:func:`mtc.testing.jobs.run_job`; in the script, :func:`mtc.testing.join_job`)."""
        from mtc.testing.jobs import run_job

        return run_job(self, argv, hosts=hosts, devices_per_process=devices_per_process,
                       env=env, reference=reference, timeout=timeout)

    # -- reports --------------------------------------------------------------------

    def log_tails(self, n: int = LOG_TAIL_CHARS) -> str:
        """The end of every host's sidecar and replicator logs."""
        out = []
        for h in range(self.num_hosts):
            for what in ("sidecar", "replicator"):
                out.append(f"--- host {h} {what} ---\n{self.local.hosts.log_tail(h, what, n)}")
        return "\n".join(out)


def _step(step: object) -> int:
    """``step``, checked: a step no save can have is refused now, not waited for."""
    if isinstance(step, bool) or not hasattr(step, "__index__") or step.__index__() < 0:
        raise ConfigError(f"step {step!r}: a step is an integer >= 0")
    return int(step.__index__())


def _is_index(i: object, n: int) -> bool:
    # bool is an int, but True is no host; numpy's integers are fine
    return (not isinstance(i, bool) and hasattr(i, "__index__")
            and 0 <= i.__index__() < n)


@contextmanager
def local_cluster(*, slices: int = 2, hosts_per_slice: int = 2, base: Path | None = None,
                  backup: str | None = None, backup_every_steps: int | None = None
                  ) -> Iterator[TestCluster]:
    """:meth:`TestCluster.up`, taken down on leaving; when the block raises, the
    hosts' log tails go to stderr first."""
    cluster = TestCluster.up(slices=slices, hosts_per_slice=hosts_per_slice, base=base,
                             backup=backup, backup_every_steps=backup_every_steps)
    try:
        yield cluster
    except BaseException:
        print(cluster.log_tails(), file=sys.stderr)
        raise
    finally:
        cluster.down()


def options_from_env(**kw: Any) -> mtc.Options:
    """In a script :meth:`TestCluster.run_script` started: the cluster's
    :meth:`TestCluster.options` (``TestCluster.from_env().options(**kw)``)."""
    return TestCluster.from_env().options(**kw)
