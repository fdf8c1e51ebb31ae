"""docs/multi-controller.md, run as written on hosts of one machine: ``mtc certs`` as
the page types it; four replicators started by ``deploy/vm/mtc-replicator.service``'s
``ExecStart``, expanded from ``deploy/vm/replicator.env`` with each host's values
(the edits the page has a user make: rank, addresses, folders); the page's program
as a job of four ``jax.distributed`` processes over mutual TLS; ``mtc status`` as
the page types it. One host's RAM disk is then emptied (a reboot) and its
replicator started again: the job resumes, that host's data from its peer.

What cannot run here is left out and said: ``sudo``, ``systemctl``, mounts. The
unit itself is checked by ``systemd-analyze verify`` where systemd is installed,
and in every case by parsing it and handing its command line to the replicator's
own argument parser. The addresses are loopback ports instead of ``10.0.0.x:9470``."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from doc_blocks import python_block
from replicators import env_with_repo, wait_healthy
from xla_flags import cpu_flags

from mtc.credentials import Credentials
from mtc.ports import free_ports
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.main import parse_args
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.testing.replicas import Replicators

REPO = Path(__file__).resolve().parents[1]
PAGE = "docs/multi-controller.md"
UNIT = REPO / "deploy" / "vm" / "mtc-replicator.service"
ENV_FILE = REPO / "deploy" / "vm" / "replicator.env"
INSTALL = "/opt/mtc/bin/"  # the page's install prefix; here, this interpreter's
BIN = Path(sys.executable).parent
EXAMPLE_HOSTS = ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]
HOSTS_PER_SLICE = 2
JOB_TIMEOUT_S = 240.0


def unit_sections(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file's sections: each key's values in order (continuation lines joined,
    comments dropped), as systemd reads them."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    logical = re.sub(r"\\\n", " ", text)
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"{UNIT.name}: {line!r} before any section"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def env_values(text: str) -> dict[str, str]:
    """An EnvironmentFile's NAME=value lines."""
    out = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", name), line
            out[name] = value
    return out


def exec_start(env: dict[str, str]) -> list[str]:
    """The unit's ExecStart with ``env`` as systemd expands it: ``${NAME}`` one word,
    ``$NAME`` split at whitespace (an empty one vanishes)."""
    (line,) = unit_sections(UNIT.read_text())["Service"]["ExecStart"]
    words = []
    for word in shlex.split(line):
        if re.fullmatch(r"\$[A-Z_][A-Z0-9_]*", word):
            words.extend(env[word[1:]].split())
            continue
        words.append(re.sub(r"\$\{([A-Z_][A-Z0-9_]*)\}", lambda m: env[m.group(1)], word))
    return words


def test_the_unit_runs_the_replicator_with_flags_it_accepts() -> None:
    unit = unit_sections(UNIT.read_text())
    env = env_values(ENV_FILE.read_text())
    assert unit["Service"]["EnvironmentFile"] == ["/etc/mtc/replicator.env"]
    used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", unit["Service"]["ExecStart"][0]))
    assert used <= set(env), f"the unit reads variables the env file lacks: {used - set(env)}"
    argv = exec_start(env)
    assert argv[0] == INSTALL + "mtc-replicator"
    args = parse_args(argv[1:])  # the replicator's own parser: an unknown flag exits
    assert (args.rank, args.nodes_per_slice, args.keep, args.replicas) == (0, 2, 2, 1)
    assert args.listen in args.nodes.split(",")
    assert args.tls_cert == "/etc/mtc/pki/rank-0.crt" and args.tls_ca == "/etc/mtc/pki/ca.crt"
    assert args.local_dir == "/dev/shm/mtc"


@pytest.mark.process
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd here")
def test_systemd_finds_nothing_wrong_with_the_unit(tmp_path: Path) -> None:
    unit = tmp_path / UNIT.name
    # verify checks that the program exists: point it at an installed one.
    unit.write_text(UNIT.read_text().replace(INSTALL + "mtc-replicator", "/bin/true"))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def sh_block(heading: str, first: str) -> str:
    """The first ```sh block after ``heading`` that starts with ``first``."""
    text = (REPO / PAGE).read_text()
    text = text[text.index(heading):]
    for m in re.finditer(r"```sh\n(.*?)```", text, re.S):
        if m.group(1).startswith(first):
            return m.group(1)
    raise AssertionError(f"{PAGE}: no sh block starting {first!r} under {heading!r}")


class VmHosts(Replicators):
    """Four hosts' replicators on loopback, each from the unit and its env file; what
    they hold and the waits on it are :class:`~mtc.testing.replicas.Replicators`'."""

    n, per_slice = len(EXAMPLE_HOSTS), HOSTS_PER_SLICE

    def __init__(self, base: Path) -> None:
        self.base = base
        self.ports = free_ports(len(EXAMPLE_HOSTS))
        self.nodes = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.pki = base / "pki"

    def ram_disk(self, rank: int) -> Path:
        return self.base / f"host-{rank}" / "shm-mtc"

    def env_file(self, rank: int) -> dict[str, str]:
        """deploy/vm/replicator.env with this host's values, as the page edits it."""
        env = env_values(ENV_FILE.read_text())
        env.update(MTC_RANK=str(rank), MTC_LISTEN=f"127.0.0.1:{self.ports[rank]}",
                   MTC_NODES=self.nodes, MTC_LOCAL_DIR=str(self.ram_disk(rank)),
                   MTC_PKI=str(self.pki), MTC_BACKUP=(self.base / "backup").as_uri(),
                   MTC_METRICS_PORT="0")
        return env

    def start(self, rank: int) -> None:
        argv = exec_start(self.env_file(rank))
        argv[0] = str(BIN / Path(argv[0]).name)
        log = (self.base / f"replicator-{rank}.log").open("ab")
        self.procs[rank] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            env=env_with_repo())
        wait_healthy(f"127.0.0.1:{self.ports[rank]}", lambda: self.procs[rank].poll() is None,
                     self.controller(), lambda: self.log(rank), timeout=60)

    def log(self, rank: int) -> str:
        return (self.base / f"replicator-{rank}.log").read_text()[-4000:]

    def stop(self, rank: int) -> None:
        p = self.procs.pop(rank)
        p.terminate()  # systemctl's SIGTERM
        p.wait(timeout=60)

    def controller(self) -> Credentials:
        return Credentials(tls_cert=self.pki / "controller.crt",
                           tls_key=self.pki / "controller.key", tls_ca=self.pki / "ca.crt")

    def alive(self, rank: int) -> bool:
        return rank in self.procs and self.procs[rank].poll() is None

    def inventory(self, rank: int) -> pb.Inventory:
        client = PeerClient(f"127.0.0.1:{self.ports[rank]}", self.controller(), rank=rank,
                            deadline_s=5.0)
        try:
            return client.call("GetInventory", pb.InventoryRequest(), attempts=1)
        finally:
            client.close()

    def log_text(self, rank: int) -> str:
        return self.log(rank)

    def run_job(self, program: Path, steps: int) -> list[list[str]]:
        """The page's program on every host, process r on host r; each one's own lines."""
        (coordinator,) = free_ports(1)
        procs = []
        for r in range(len(EXAMPLE_HOSTS)):
            env = {**env_with_repo(), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
                   "XLA_FLAGS": cpu_flags(2),
                   "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{coordinator}",
                   "JAX_NUM_PROCESSES": str(len(EXAMPLE_HOSTS)), "JAX_PROCESS_ID": str(r),
                   "MTC_NODES": self.nodes, "MTC_PKI": str(self.pki),
                   "MTC_LOCAL_DIR": str(self.ram_disk(r))}
            procs.append(subprocess.Popen([sys.executable, str(program), str(steps)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          stdin=subprocess.DEVNULL, text=True))
        outs = []
        try:
            for r, p in enumerate(procs):
                out, err = p.communicate(timeout=JOB_TIMEOUT_S)
                assert p.returncode == 0, f"process {r}: {err[-6000:]}"
                outs.append([x for x in out.splitlines() if x.startswith(("resumed", "done"))])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
        return outs

    def close(self) -> None:
        for rank in list(self.procs):
            self.procs[rank].kill()
            self.procs.pop(rank).wait(timeout=30)


@pytest.fixture
def vm() -> Iterator[VmHosts]:
    base = Path("/dev/shm") / f"mtc-vm-recipe-{uuid.uuid4().hex[:8]}"  # a tmpfs, as on a VM
    base.mkdir()
    h = VmHosts(base)
    try:
        yield h
    finally:
        h.close()
        shutil.rmtree(base, ignore_errors=True)


def on_loopback(command: str, vm: VmHosts) -> str:
    """A command of the page with the example hosts' addresses replaced by loopback's."""
    for rank, host in enumerate(EXAMPLE_HOSTS):
        command = command.replace(f"{host}:9470", f"127.0.0.1:{vm.ports[rank]}")
    return command


@pytest.mark.process
@pytest.mark.timeout(JOB_TIMEOUT_S * 3)
def test_the_recipe_runs_and_a_rebooted_host_resumes_from_its_peer(vm: VmHosts) -> None:
    env = {**env_with_repo(), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    certs = sh_block("## 1. Credentials", "mtc certs")
    r = subprocess.run(certs, shell=True, cwd=vm.base, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert {"ca.crt", "rank-3.key", "controller.crt"} <= {p.name for p in vm.pki.iterdir()}
    for rank in range(len(EXAMPLE_HOSTS)):
        vm.start(rank)
    program = vm.base / "train.py"
    program.write_text(python_block(PAGE, "## 4. The training program"))

    first = vm.run_job(program, 20)
    assert [o[-1].split()[:2] for o in first] == [["done", "20"]] * 4, first
    vm.wait_replicated(20)
    status = on_loopback(sh_block("## 5. Check it", "mtc status"), vm)
    r = subprocess.run(status, shell=True, cwd=vm.base, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    backup = on_loopback(sh_block("## 5. Check it", "mtc backup"), vm)
    r = subprocess.run(backup, shell=True, cwd=vm.base, env=env, capture_output=True,
                       text=True, timeout=300)
    assert (r.returncode, r.stdout.strip()) == (0, "backed up step 20"), r.stdout + r.stderr

    vm.stop(1)  # host 1 reboots: its RAM disk empties, systemd starts its replicator
    shutil.rmtree(vm.ram_disk(1))
    vm.start(1)
    second = vm.run_job(program, 30)
    assert [o[0] for o in second] == ["resumed 20 local", "resumed 20 peer",
                                      "resumed 20 local", "resumed 20 local"], second
    assert len({o[-1] for o in second}) == 1 and second[0][-1].startswith("done 30 "), second
