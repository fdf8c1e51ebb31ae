"""The multi-controller harness: isolated hosts, each with its sidecar and its
replicator, and jobs of one real ``jax.distributed`` process per chosen host
(``tests/workers/mc_worker.py`` and the workers built on it).

Every JAX process runs on a host of its own (``mtc.testing.isolation.Hosts``):
with root, inside that host's network and mount namespaces (nsenter into the
host's sidecar, which owns them), its RAM disk a private tmpfs no other host
sees, its address on a bridge, ``jax.distributed`` and the collectives over that
bridge; without root, separate processes with private folders, same code. Each
host also runs its replicator, the only way bytes cross between hosts. A worker
checks every addressable shard against numpy and reports in one JSON line.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from replicators import wait_healthy
from xla_flags import cpu_flags

from mtc.ports import free_ports
from mtc.testing.isolation import Hosts
from mtc.testing.replicas import HostReplicators
from mtc.testing.waits import wait_exits

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
WORKER = WORKERS / "mc_worker.py"
RESULT_PREFIX = "MC_RESULT "
DEVICES_PER_PROCESS = 2
PHASE_TIMEOUT_S = 120.0
# After one process fails, how long the others get to finish before SIGKILL.
FAILURE_GRACE_S = 10.0
HOSTS_PER_SLICE = 2
# In a host's own network namespace nothing else listens: fixed ports are free.
REPLICATOR_PORT = 7000
# A fresh one per job (no TIME_WAIT clash), clear of the hosts' own fixed ports.
_coordinator_ports = itertools.count(7400)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = cpu_flags(DEVICES_PER_PROCESS)  # compiled as every test's JAX
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


class Cluster(HostReplicators):
    """Isolated hosts, each with its sidecar (owner of its namespaces and RAM disk)
    and its replicator; jobs run one JAX process per chosen host. What the
    replicators hold and the waits on it (``wait_held``, ``wait_replicated``) are
    :class:`~mtc.testing.replicas.HostReplicators`'."""

    def __init__(self, base: Path, n: int, *, replicators: bool) -> None:
        hosts = Hosts(base, n, ramdisk_bytes=64 << 20)
        ns = hosts.isolation == "namespaces"
        ports = [REPLICATOR_PORT] * n if ns else free_ports(n)
        super().__init__(hosts, [hosts.replicator_address(i, ports[i]) for i in range(n)]
                         if replicators else [], HOSTS_PER_SLICE)
        # Arguments added to one host's replicator (the last of a repeated flag wins).
        self.replicator_args: dict[int, list[str]] = {}
        self.env = _env()
        self.slices = [i // HOSTS_PER_SLICE for i in range(n)]

    def _replicator_argv(self, i: int) -> list[str]:
        return ["--local-dir", str(self.hosts.hosts[i].root), "--listen", self.addrs[i],
                "--nodes", ",".join(self.addrs), "--rank", str(i),
                "--nodes-per-slice", str(HOSTS_PER_SLICE), "--keep", "3",
                "--poll-seconds", "0.05", "--agreement-timeout-seconds", "30",
                *self.replicator_args.get(i, [])]

    def start(self, hosts: Sequence[int] | None = None) -> None:
        """Start the hosts' sidecars (each owns its host's namespaces and RAM disk),
        then their replicators, which join those namespaces."""
        hosts = list(range(self.n)) if hosts is None else list(hosts)
        for i in hosts:  # all at once, as a job's hosts start
            self.hosts.start_sidecar(i, self.slices, env=self.env, wait=False)
        for i in hosts:
            self.hosts.wait_sidecar(i)
        if self.addrs:
            procs = [self.hosts.start_replicator(i, self._replicator_argv(i), env=self.env)
                     for i in hosts]
            for i, p in zip(hosts, procs, strict=True):
                self._serving(i, p)

    def _serving(self, i: int, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
        wait_healthy(self.addrs[i], lambda: proc.poll() is None, None,
                     lambda: self.hosts.log_tail(i, "replicator"), timeout_s)

    def lose(self, i: int) -> None:
        """Host ``i`` is gone: its processes killed, and its RAM disk with them."""
        self.hosts.lose(i)

    def run_job(self, phase: str, on: Sequence[int], logs: Path, *, worker: Path = WORKER,
                args: Sequence[str] = (), killed: Sequence[int] = (),
                min_checks: int = 20) -> list[dict[str, Any]]:
        """Run one phase, process ``k`` on host ``on[k]`` (its host's replicator rank
        stated when ``on`` is not 0..k); every one must report and exit 0, but the
        processes ``killed``, which must die by SIGKILL (having reported)."""
        ns = self.hosts.isolation == "namespaces"
        port = next(_coordinator_ports) if ns else free_ports(1)[0]
        coordinator = f"{self.hosts.hosts[on[0]].address}:{port}"
        procs: list[subprocess.Popen[bytes]] = []
        outs: list[Path] = []
        errs: list[Path] = []
        try:
            for k, i in enumerate(on):
                h = self.hosts.hosts[i]
                argv = [sys.executable, str(worker), "--phase", phase, "--process-id", str(k),
                        "--num-processes", str(len(on)), "--coordinator", coordinator,
                        "--local-dir", str(h.root), "--hosts-per-slice", str(HOSTS_PER_SLICE)]
                argv += list(args)
                if self.addrs:
                    argv += ["--replicators", ",".join(self.addrs[j] for j in on),
                             "--token-file", str(self.hosts.token_file)]
                    if list(on) != list(range(len(on))):
                        argv += ["--replicator-ranks", ",".join(map(str, on))]
                if ns:
                    # The host's own name resolves to its address, as on a real host
                    # (JAX's CPU collectives find their peers by it).
                    argv = ["unshare", "--uts", "--", "sh", "-c",
                            f'hostname {h.address} && exec "$@"', "sh", *argv]
                out, err = logs / f"{phase}-{k}.out", logs / f"{phase}-{k}.err"
                outs.append(out)
                errs.append(err)
                with out.open("wb") as fo, err.open("wb") as fe:
                    procs.append(subprocess.Popen(h.wrap(argv), cwd=REPO, env=self.env,
                                                  stdout=fo, stderr=fe,
                                                  stdin=subprocess.DEVNULL))
            timed_out = wait_exits(procs, PHASE_TIMEOUT_S, grace_s=FAILURE_GRACE_S,
                                   expected=killed)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()  # SIGKILL: JAX traps SIGTERM and waits minutes on a barrier
            for p in procs:
                p.wait(timeout=30)

        stdout = [o.read_text(errors="replace") for o in outs]
        stderr = [e.read_text(errors="replace") for e in errs]
        report = "\n".join(
            f"--- {phase} process {k} (host {on[k]}): rc={p.returncode}\nstdout:\n"
            f"{_tail(stdout[k])}\nstderr:\n{_tail(stderr[k])}" for k, p in enumerate(procs))
        assert not timed_out, f"{phase}: processes {timed_out} still running after " \
                              f"{PHASE_TIMEOUT_S:.0f} s (killed)\n{report}"
        want = [-9 if k in killed else 0 for k in range(len(procs))]
        assert [p.returncode for p in procs] == want, \
            f"{phase}: a process failed (exit codes, wanted {want})\n{report}"
        results = []
        for k, text in enumerate(stdout):
            lines = [line for line in text.splitlines() if line.startswith(RESULT_PREFIX)]
            assert len(lines) == 1, f"{phase}: process {k} printed no result line\n{report}"
            results.append(json.loads(lines[0][len(RESULT_PREFIX):]))
        check_results(phase, results, len(on), min_checks)
        return results

    def assert_partial_membership_fails(self, ask: int, gone: int,
                                        timeout_s: float = 1.5) -> None:
        """A membership naming a host that is gone never decides: the typed error
        names it, within the deadline; one that leaves the asker out is refused."""
        from mtc.errors import AgreementError, ConfigError
        from mtc.replicas import prepare_restore

        t0 = time.monotonic()
        # Named once: the host gone (the decider of that membership, unreachable).
        with pytest.raises(AgreementError, match=rf"Decide to .*\(host {gone}\)$") as err:
            prepare_restore([self.addrs[ask]], token=self.hosts.token(), timeout_s=timeout_s,
                            members=(ask, gone), ranks=(ask,))
        assert str(err.value).count("(host") == 1, err.value
        # Bounded, not a performance figure: the deadline plus the RPCs' slack.
        assert time.monotonic() - t0 < timeout_s + 30
        with pytest.raises(ConfigError, match="does not include it"):
            prepare_restore([self.addrs[ask]], token=self.hosts.token(), timeout_s=timeout_s,
                            members=(gone,), ranks=(ask,))

    def assert_private(self) -> None:
        """With namespaces, no host's RAM disk is visible from here."""
        if self.hosts.isolation == "namespaces":
            for h in self.hosts.hosts:
                assert list(h.root.iterdir()) == [], f"host {h.index}'s RAM disk is visible"

    def down(self) -> None:
        tails = {i: (self.hosts.log_tail(i, "sidecar"), self.hosts.log_tail(i, "replicator"))
                 for i in range(self.n)}
        self.hosts.down()
        for i, (side, rep) in tails.items():
            print(f"--- host {i} sidecar ---\n{side}\n--- host {i} replicator ---\n{rep}")


@contextlib.contextmanager
def cluster(n: int, *, replicators: bool,
            replicator_args: Callable[[list[str]], dict[int, list[str]]] | None = None
            ) -> Iterator[Cluster]:
    """Started hosts; ``replicator_args(addresses)``: more arguments of some hosts'
    replicators, by host."""
    c = Cluster(Path("/dev/shm") / f"mtc-mc-{uuid.uuid4().hex[:8]}", n,
                replicators=replicators)
    if replicator_args is not None:
        c.replicator_args = replicator_args(c.addrs)
    try:
        c.start()
        yield c
    finally:
        c.down()


def check_results(phase: str, results: list[dict[str, Any]], num_processes: int,
                  min_checks: int = 20) -> None:
    assert [r["process_index"] for r in results] == list(range(num_processes))
    for r in results:
        assert r["process_count"] == num_processes
        assert r["num_devices"] == num_processes * DEVICES_PER_PROCESS
        assert len(r["local_devices"]) == DEVICES_PER_PROCESS
    errors = [e for r in results for e in r["errors"]]
    assert not errors, f"{phase}: {len(errors)} mismatches:\n" + "\n".join(errors[:40])
    for r in results:
        assert r["checks"] >= min_checks, \
            f"{phase}: process {r['process_index']} ran too few checks"
