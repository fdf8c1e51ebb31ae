"""A multi-controller job on a :class:`~mtc.testing.TestCluster`: one JAX process per
host, each inside its host (its network and mount namespaces with root), its RAM
disk its ``local_dir``, as on a TPU VM.

The test calls :func:`run_job`; each process of the user's script calls
:func:`join_job`, which starts ``jax.distributed`` and returns the process's
``local_dir`` and ``mtc.Options``.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtc.errors import ConfigError
from mtc.lifecycle import Threads
from mtc.ports import free_ports
from mtc.testing.cluster import LOG_TAIL_CHARS, ScriptError, TestCluster
from mtc.testing.waits import wait_exits

if TYPE_CHECKING:
    import mtc

FAILURE_GRACE_S = 10.0  # after one process fails, the others' time to finish (a collective
# with a dead peer never returns: they are SIGKILLed, as JAX traps SIGTERM)
POLL_S = 0.05
# Each job's coordinator port inside the first host's namespace: nothing else listens
# there, but a port just closed may linger (TIME_WAIT), so each job takes another.
NS_COORDINATOR_PORTS = (7400, 7999)


def run_job(cluster: TestCluster, argv: Sequence[str], *, hosts: Sequence[int] | None = None,
            devices_per_process: int = 2, env: Mapping[str, str] | None = None,
            reference: Path | None = None,
            timeout: float = 300.0) -> list[subprocess.CompletedProcess[str]]:
    """Run ``python argv...`` as process ``k`` of a job on host ``hosts[k]`` (default
    every host, in order), each with ``devices_per_process`` CPU devices; until all
    exit. Returns their outputs in process order. A process that exits non-zero
    (or the job past ``timeout``) raises :class:`ScriptError` naming it, after the
    others are given a few seconds and then SIGKILLed.

    ``reference``: the same job as a reference run, sharing nothing with the
    cluster's: :func:`join_job` gives each process a folder of its own under
    ``reference`` and no replicators."""
    local = cluster.local
    on = list(range(cluster.num_hosts) if hosts is None else map(cluster.host, hosts))
    if not on:
        raise ConfigError("hosts []: a job runs on one host or more")
    if len(set(on)) != len(on):
        raise ConfigError(f"hosts {list(on)}: one process per host, each host once")
    for i in on:
        h = local.hosts.hosts[i]
        if h.sidecar_pid is None and h.replicator_pid is None:
            # Nothing of the host runs: its process would run outside any host, never
            # join the job, and the others would wait for it until the job's timeout.
            raise ConfigError(f"host {i} is down (lost: kill_host, lose_slice): "
                              f"restart_host({i}) brings it back empty, or leave it out "
                              f"of hosts=[...]")
    namespaces = local.isolation == "namespaces"
    port = (random.SystemRandom().randint(*NS_COORDINATOR_PORTS) if namespaces
            else free_ports(1)[0])
    coordinator = f"{local.hosts.hosts[on[0]].address}:{port}"
    base_env = {**cluster.script_env(), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
                "XLA_FLAGS": _xla_flags(devices_per_process),
                "MTC_TESTING_JOB_HOSTS": ",".join(map(str, on)),
                "MTC_TESTING_COORDINATOR": coordinator,
                **({"MTC_TESTING_REFERENCE": str(reference)} if reference else {}),
                **(env or {})}
    procs: list[subprocess.Popen[str]] = []
    failed: list[int] = []  # the processes that exited non-zero, in the order they did
    try:
        for k, i in enumerate(on):
            h = local.hosts.hosts[i]
            cmd = [sys.executable, *argv]
            if namespaces:
                # The host's name resolves to its address, as on a real host: JAX's CPU
                # collectives find their peers by it.
                cmd = ["unshare", "--uts", "--", "sh", "-c", f'hostname {h.address} && exec "$@"',
                       "sh", *cmd]
            procs.append(subprocess.Popen(h.wrap(cmd), env={**base_env, "MTC_TESTING_PROCESS":
                                                              str(k)},
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          stdin=subprocess.DEVNULL, text=True))
            cluster.job_started(i, procs[-1])
        outs = _wait(procs, timeout, failed)
    finally:
        for i in on:
            cluster.job_ended(i)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    done = [subprocess.CompletedProcess(p.args, p.returncode, o, e)
            for p, (o, e) in zip(procs, outs, strict=True)]
    error = job_error(done, failed, [f"host {i} ({local.hosts.hosts[i].address})" for i in on],
                      argv, timeout,
                      lost=[k for k, i in enumerate(on) if cluster.lost_during_job(i)])
    if error is not None:
        raise error
    return done


def _xla_flags(devices: int) -> str:
    """This process's ``XLA_FLAGS`` (a test's own choices, such as its compiler's
    optimisation level) with ``devices`` CPU devices instead of its device count."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


def raised(stderr: str, limit: int = 1000) -> str:
    """The exception a Python process's ``stderr`` ends on: the first line of the last
    traceback's exception ("" when there is none: a signal, ``os._exit``)."""
    _, header, trace = stderr.rpartition("Traceback (most recent call last):\n")
    if not header:
        return ""
    for line in trace.splitlines():
        if line and not line[0].isspace():
            return line[:limit]
    return ""


def job_error(done: Sequence[subprocess.CompletedProcess[str]], failed: Sequence[int],
              where: Sequence[str], argv: Sequence[str], timeout: float,
              lost: Sequence[int] = ()) -> ScriptError | None:
    """The error a job's end makes (None: every process exited 0). It names the first
    process that failed (``failed``: those that exited non-zero, in order), its host
    (``where[k]``) and its exit status; those the harness SIGKILLed after it, or that
    failed later waiting on it (a collective's timeout), are only listed. A job that
    ran past ``timeout`` with no process failed names every process still running.
    ``lost``: the processes whose host was lost while the job ran (a fault
    SIGKILLed them with it)."""
    if all(d.returncode == 0 for d in done):
        return None
    def tails(but: int = -1) -> str:
        return "".join(f"\n--- process {j} on {where[j]} stderr ---\n"
                       f"{(x.stderr or '')[-LOG_TAIL_CHARS // 2:]}"
                       for j, x in enumerate(done) if j != but)

    if failed:
        k = failed[0]
        after = [j for j, d in enumerate(done) if j != k and d.returncode != 0]
        note = (f"process {k} on {where[k]} failed first, with exit status "
                f"{done[k].returncode}"
                + (" (SIGKILLed: its host was lost while it ran)" if k in lost else "")
                + (f"; then processes {after} stopped (exit statuses "
                   f"{[done[j].returncode for j in after]}: killed by the harness "
                   f"{FAILURE_GRACE_S:g}s after it, or failed waiting on it)" if after else ""))
        if line := raised(done[k].stderr or ""):
            # What it raised says what failed (another host's replicator, say): it
            # is read first, not after thousands of characters of traceback.
            note += f"\nprocess {k} raised {line}"
        stderr = (done[k].stderr or "")[-LOG_TAIL_CHARS:] + tails(k)
        return ScriptError(done[k].returncode, [f"process {k} on {where[k]}", *argv],
                           done[k].stdout, stderr, note=note, tail_chars=len(stderr))
    late = [j for j, d in enumerate(done) if d.returncode != 0]
    note = (f"the job ran past its timeout ({timeout:g}s): processes {late} "
            f"({', '.join(where[j] for j in late)}) were still running and were SIGKILLed")
    stderr = tails()
    return ScriptError(done[late[0]].returncode, [f"processes {late}", *argv], "", stderr,
                       note=note, tail_chars=len(stderr))


def _wait(procs: list[subprocess.Popen[str]], timeout: float,
          failed: list[int] | None = None) -> list[tuple[str, str]]:
    """Until every process exits, reading their output as it comes (a full pipe would
    stall a process); SIGKILL whoever is left ``FAILURE_GRACE_S`` after one fails,
    or at ``timeout``. ``failed`` gets the processes that exit non-zero before that,
    in the order they do (those SIGKILLed here are not in it)."""
    failed = [] if failed is None else failed
    outs: list[tuple[str, str]] = [("", "")] * len(procs)

    def read(k: int) -> None:
        outs[k] = procs[k].communicate()

    readers = Threads("mtc-job-readers")  # joined below, once every process exited
    for k in range(len(procs)):
        readers.start(read, f"mtc-job-{k}", k)
    wait_exits(procs, timeout, grace_s=FAILURE_GRACE_S, failed=failed, poll_s=POLL_S)
    for p in procs:
        if p.poll() is None:
            p.kill()
    readers.join()  # a reader's own error is raised
    return outs


def join_job(**kw: Any) -> tuple[Path, mtc.Options]:
    """In a process :func:`run_job` started: ``jax.distributed.initialize`` for this
    job, then this process's ``local_dir`` (its host's RAM disk) and ``mtc.Options``
    (``kw``, plus the job's replicators, their ranks and token)."""
    import jax

    import mtc

    cluster = TestCluster.from_env()
    hosts = [int(h) for h in os.environ["MTC_TESTING_JOB_HOSTS"].split(",")]
    k = int(os.environ["MTC_TESTING_PROCESS"])
    jax.distributed.initialize(coordinator_address=os.environ["MTC_TESTING_COORDINATOR"],
                               num_processes=len(hosts), process_id=k,
                               initialization_timeout=60)
    reference = os.environ.get("MTC_TESTING_REFERENCE")
    if reference:  # run_job(reference=...): nothing shared with the cluster
        return Path(reference) / f"process-{k}", mtc.Options(
            **{"hosts_per_slice": cluster.hosts_per_slice, **kw})
    local = cluster.local
    options = mtc.Options(**{
        # The host's RAM disk is this process's local_dir, its replicator's folder,
        # also when the job is one process (a job come back on one host), which
        # mtc would otherwise take for one machine playing every host.
        "host_subdirs": False,
        "hosts_per_slice": cluster.hosts_per_slice,
        "replicators": tuple(local.addresses[h] for h in hosts),
        "replicator_ranks": tuple(hosts) if hosts != list(range(len(hosts))) else None,
        "replicator_token": local.token(), **kw})
    return local.root(hosts[k]), options
