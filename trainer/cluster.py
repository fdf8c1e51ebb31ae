"""``mtc-cluster``: a local cluster of simulated hosts, one command up, one down.

    python -m mtc_trainer.cluster up   [--name N] [--slices 2] [--hosts-per-slice 2]
                                   [--backup URL | --backup gcs-emulator]
    python -m mtc_trainer.cluster status [--name N]
    python -m mtc_trainer.cluster down [--name N]

``up`` gives every simulated host a RAM-disk root ``/dev/shm/mtc-cluster-<name>/host-<i>``
and starts one real ``mtc-replicator`` process per host (peer copies in the
other slice, backups to ``<base>/backup``, or with ``--backup gcs-emulator`` to
a bucket in a fake-gcs-server it starts), waits until each serves, and writes
the addresses and process ids to ``<base>/cluster.json``. ``down`` reads that
file, SIGKILLs the replicators (the way a host dies), stops the emulator and
removes the folder. ``status`` is ``mtc status`` against every host's replicator.

The training process finds the cluster through the same file and uses
:class:`LocalCluster` to inject host failures: SIGKILL a host's replicator,
wipe its RAM disk, start it again empty.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mtc_trainer import gcs_emulator

REPO = Path(__file__).resolve().parents[1]
STATE = "cluster.json"
GCS_EMULATOR = "gcs-emulator"  # --backup value: start fake-gcs-server, back up there
EMULATOR_BUCKET = "mtc-local"
PORT_FILE_CHECK_S = 0.005  # a stat of a local file: cheap enough to do this often


def default_base(name: str) -> Path:
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return root / f"mtc-cluster-{name}"


def free_ports(n: int) -> list[int]:
    """Loopback ports free right now (a server binding them later may still race)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


@dataclasses.dataclass
class LocalCluster:
    """Replicator processes over ``<base>/host-<i>``; persisted in ``<base>/cluster.json``."""

    base: Path
    slices: int
    hosts_per_slice: int
    addresses: list[str]
    pids: dict[int, int]
    backup: str
    poll_seconds: float = 0.2
    straggler_wait_seconds: float = 2.0
    emulator: dict[str, Any] | None = None  # the GCS emulator backed up to: url, pid

    @property
    def num_hosts(self) -> int:
        return self.slices * self.hosts_per_slice

    def root(self, rank: int) -> Path:
        return self.base / f"host-{rank}"

    def env(self) -> dict[str, str]:
        """The replicators' environment (the emulator's address when backing up to it)."""
        env = _env()
        if self.emulator is not None:
            env["STORAGE_EMULATOR_HOST"] = self.emulator["url"]
        return env

    def compile_cache_dir(self) -> Path:
        """Where trainers on this cluster keep JAX's persistent compilation cache by default."""
        return self.base / "compile-cache"

    def port_file(self, rank: int) -> Path:
        return self.base / "logs" / f"replicator-{rank}.port"

    def hosts_of_slice(self, s: int) -> list[int]:
        return list(range(s * self.hosts_per_slice, (s + 1) * self.hosts_per_slice))

    # -- persistence ----------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["base"] = str(self.base)
        d["pids"] = {str(k): v for k, v in self.pids.items()}
        return d

    def save(self) -> None:
        tmp = self.base / (STATE + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(self.base / STATE)

    @classmethod
    def load(cls, base: Path) -> LocalCluster:
        d = json.loads((base / STATE).read_text())
        d["base"] = Path(d["base"])
        d["pids"] = {int(k): v for k, v in d["pids"].items()}
        return cls(**d)

    # -- processes ---------------------------------------------------------------

    def launch(self, rank: int) -> None:
        """Start ``rank``'s replicator (its own session: it outlives whoever started it)."""
        logs = self.base / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.port_file(rank).unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "mtc_sidecar.replicator.main",
               "--local-dir", str(self.root(rank)), "--listen", self.addresses[rank],
               "--nodes", ",".join(self.addresses), "--rank", str(rank),
               "--nodes-per-slice", str(self.hosts_per_slice), "--replicas", "1",
               "--backup", self.backup, "--backup-interval-minutes", "60",
               "--poll-seconds", str(self.poll_seconds),
               "--straggler-wait-seconds", str(self.straggler_wait_seconds),
               "--port-file", str(self.port_file(rank))]
        with (logs / f"replicator-{rank}.log").open("ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                    cwd=REPO, start_new_session=True)
        self.pids[rank] = proc.pid

    def wait_serving(self, rank: int, timeout: float = 30.0) -> None:
        """Until ``rank``'s replicator serves: it writes its port file once its
        server is up (watched with a stat every few milliseconds, no RPC), then
        one health check confirms."""
        import grpc

        from mtc_sidecar.replicator.healthcheck import check

        deadline = time.monotonic() + timeout
        port_file = self.port_file(rank)
        while time.monotonic() < deadline:
            if not self.alive(rank):
                log = (self.base / "logs" / f"replicator-{rank}.log").read_text(errors="replace")
                raise RuntimeError(f"replicator {rank} exited: {log[-2000:]}")
            if not port_file.exists():
                time.sleep(PORT_FILE_CHECK_S)
                continue
            try:
                if check(self.addresses[rank], timeout_s=1.0) == "SERVING":
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"replicator {rank} not serving after {timeout}s")

    def alive(self, rank: int) -> bool:
        pid = self.pids.get(rank)
        if pid is None:
            return False
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)  # reaps it when it is our child
            if done:
                return False
        except ChildProcessError:
            pass  # not our child: probe it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return _state_of(pid) != "Z"

    def kill(self, rank: int) -> None:
        """SIGKILL ``rank``'s replicator: no handler runs, nothing is flushed."""
        pid = self.pids.pop(rank, None)
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    return
            except ChildProcessError:
                if not Path(f"/proc/{pid}").exists() or _state_of(pid) == "Z":
                    return
            time.sleep(0.01)

    def wipe(self, rank: int) -> None:
        """Lose ``rank``'s RAM disk: everything under its root is gone.

        A file takes the root's place until the host is back, so that nothing
        in a surviving process (a save still being written for this host) can
        recreate the folder and commit into it: a dead host writes nothing.
        """
        root = self.root(rank)
        tomb = root.with_name(root.name + ".lost")
        try:
            root.rename(tomb)
        except FileNotFoundError:
            pass
        tmp = root.with_name(root.name + ".down")
        tmp.write_text("this host is down\n")
        tmp.replace(root)
        shutil.rmtree(tomb, ignore_errors=True)

    def lose_host(self, rank: int) -> None:
        self.kill(rank)
        self.wipe(rank)
        self.save()

    def restart_host(self, rank: int, *, wait: bool = True) -> None:
        """Bring ``rank`` back: a new, empty RAM disk and a new replicator process."""
        root = self.root(rank)
        if root.is_file():
            root.unlink()
        root.mkdir(parents=True, exist_ok=True)
        self.launch(rank)
        self.save()
        if wait:
            self.wait_serving(rank)

    # -- whole cluster ------------------------------------------------------------

    @classmethod
    def up(cls, base: Path, *, slices: int = 2, hosts_per_slice: int = 2,
           backup: str | None = None) -> LocalCluster:
        if (base / STATE).exists():
            raise SystemExit(f"a cluster already runs in {base} (take it down first)")
        base.mkdir(parents=True, exist_ok=True)
        n = slices * hosts_per_slice
        backup = backup or (base / "backup").as_uri()
        if backup.startswith("file://"):
            Path(backup.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
        emulator = None
        if backup == GCS_EMULATOR:
            emulator = _start_emulator(base)
            backup = f"gs://{EMULATOR_BUCKET}/checkpoints"
        cluster = cls(base, slices, hosts_per_slice,
                      [f"127.0.0.1:{p}" for p in free_ports(n)], {}, backup,
                      emulator=emulator)
        for r in range(n):
            cluster.root(r).mkdir(parents=True, exist_ok=True)
            cluster.launch(r)
        cluster.save()
        try:
            for r in range(n):
                cluster.wait_serving(r)
        except BaseException:
            cluster.down()
            raise
        return cluster

    def down_latest(self) -> None:
        """Tear down, with the pids a trainer may have changed (it restarts
        replicators) read back from the state file."""
        try:
            current = LocalCluster.load(self.base)
        except (OSError, ValueError):
            current = self
        current.down()

    def down(self) -> None:
        for r in list(self.pids):
            self.kill(r)
        if self.emulator is not None:
            gcs_emulator.stop(self.emulator["pid"])
        shutil.rmtree(self.base, ignore_errors=True)


def _start_emulator(base: Path) -> dict[str, Any]:
    """The GCS emulator in its own session (it outlives ``up``, as the replicators do)."""
    (base / "logs").mkdir(parents=True, exist_ok=True)
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    proc = gcs_emulator.start(port, base / "logs" / "gcs-emulator.log", start_new_session=True)
    try:
        gcs_emulator.wait_ready(proc, url)
        gcs_emulator.create_bucket(url, EMULATOR_BUCKET)
    except BaseException:
        proc.kill()
        raise
    return {"url": url, "pid": proc.pid}


def _state_of(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "X"
    return stat.rsplit(")", 1)[1].split()[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mtc-cluster", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("up", "down", "status"))
    p.add_argument("--name", default="local")
    p.add_argument("--base", type=Path, help="default: /dev/shm/mtc-cluster-<name>")
    p.add_argument("--slices", type=int, default=2)
    p.add_argument("--hosts-per-slice", type=int, default=2)
    p.add_argument("--backup", help="backup URL (default: file://<base>/backup), or "
                   f"{GCS_EMULATOR!r}: start fake-gcs-server and back up to a bucket there")
    args = p.parse_args(argv)
    base = args.base or default_base(args.name)
    if args.command == "up":
        c = LocalCluster.up(base, slices=args.slices, hosts_per_slice=args.hosts_per_slice,
                            backup=args.backup)
        print(f"cluster {base}: {c.num_hosts} hosts in {c.slices} slices, replicators "
              f"{','.join(c.addresses)}, backup {c.backup}")
        print(f"  status: python -m mtc.cli status --nodes {','.join(c.addresses)}")
        return 0
    if not (base / STATE).exists():
        print(f"no cluster in {base}", file=sys.stderr)
        return 0 if args.command == "down" else 1
    c = LocalCluster.load(base)
    if args.command == "down":
        c.down()
        print(f"cluster {base}: replicators stopped, RAM disks removed")
        return 0
    from mtc.cli import status

    return status(c.addresses, None, False)


if __name__ == "__main__":
    sys.exit(main())
