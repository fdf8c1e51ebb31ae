"""The local cluster works on a machine whose firewall drops forwarded traffic.

Docker sets the firewall's FORWARD policy to DROP and turns bridge netfilter on;
a bridge in that namespace then drops the traffic between the ports on it. The
test makes such a machine: a network namespace of its own with an nftables
FORWARD chain whose policy is drop (bridge netfilter is on by default), shows
that two namespaces on a bridge there cannot reach each other (the control), and
then brings the local cluster up, asks its status and takes it down from inside
that namespace. Everything is created inside namespaces the test owns and
removed at the end; nothing outside them is touched.

Needs root and ``nft``: CI installs nftables and sets ``MTC_REQUIRE_NFT=1``, under
which a missing one fails the run; elsewhere the test is skipped and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from replicators import env_with_repo

pytestmark = pytest.mark.process

if os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("ip"):
    why = "needs root, ip and nft (apt-get install nftables)"
    if os.environ.get("MTC_REQUIRE_NFT"):
        pytest.fail(why, pytrace=False)
    pytest.skip(why, allow_module_level=True)


def sh(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env=env_with_repo())
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")
    return r


@pytest.fixture
def docker_like() -> Iterator[str]:
    """A namespace whose firewall drops forwarded traffic, as Docker leaves a host."""
    ns = f"mtcfw{uuid.uuid4().hex[:6]}"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "nft", "add", "table", "inet", "mtcfw")
        sh("ip", "netns", "exec", ns, "nft", "add", "chain", "inet", "mtcfw", "forward",
           "{ type filter hook forward priority 0; policy drop; }")
        nf = sh("ip", "netns", "exec", ns, "cat", "/proc/sys/net/bridge/bridge-nf-call-iptables")
        assert nf.stdout.strip() == "1", "bridge netfilter is off: the test would prove nothing"
        yield ns
    finally:
        sh("ip", "netns", "del", ns, check=False)


def test_a_bridge_in_that_namespace_drops_its_ports_traffic(docker_like: str) -> None:
    """The control: what the local cluster did before, here, fails."""
    tag = uuid.uuid4().hex[:5]
    a, b = f"mtcfa{tag}", f"mtcfb{tag}"
    inside = ("ip", "netns", "exec", docker_like)
    try:
        for n in (a, b):
            sh("ip", "netns", "add", n)
        sh(*inside, "ip", "link", "add", f"br{tag}", "type", "bridge")
        sh(*inside, "ip", "link", "set", f"br{tag}", "up")
        for i, n in enumerate((a, b)):
            sh(*inside, "ip", "link", "add", f"v{tag}{i}", "type", "veth", "peer", "name",
               f"w{tag}{i}", "netns", n)
            sh(*inside, "ip", "link", "set", f"v{tag}{i}", "master", f"br{tag}")
            sh(*inside, "ip", "link", "set", f"v{tag}{i}", "up")
            sh("ip", "-n", n, "addr", "add", f"10.254.77.{2 + i}/24", "dev", f"w{tag}{i}")
            sh("ip", "-n", n, "link", "set", f"w{tag}{i}", "up")
        listener = subprocess.Popen(["ip", "netns", "exec", b, sys.executable, "-c",
                                     "import socket,time; s=socket.socket(); "
                                     "s.bind(('10.254.77.3', 7999)); s.listen(); "
                                     "print('listening', flush=True); time.sleep(20)"],
                                    stdout=subprocess.PIPE)
        try:
            # Listening before the probe: else a refused connection would pass for a
            # dropped one.
            assert listener.stdout is not None
            assert listener.stdout.readline() == b"listening\n"
            probe = sh("ip", "netns", "exec", a, sys.executable, "-c",
                       "import socket\n"
                       "try:\n"
                       "    socket.create_connection(('10.254.77.3', 7999), 2).close()\n"
                       "    print('reached')\n"
                       "except OSError as e:\n"
                       "    print('dropped', e)\n")
        finally:
            listener.kill()
            listener.wait()
        assert probe.stdout.startswith("dropped"), probe.stdout
    finally:
        for n in (a, b):
            sh("ip", "netns", "del", n, check=False)


def test_the_local_cluster_comes_up_and_down_behind_that_firewall(docker_like: str) -> None:
    base = Path("/dev/shm") / f"mtc-fw-{uuid.uuid4().hex[:8]}"
    inside = ("ip", "netns", "exec", docker_like, sys.executable, "-m", "mtc.trainer.cluster")
    tag = None
    try:
        up = sh(*inside, "up", "--base", str(base), "--slices", "2", "--hosts-per-slice", "1",
                timeout=240)
        assert "2 hosts in 2 slices" in up.stdout, up.stdout
        status = sh(*inside, "status", "--base", str(base), check=False)
        assert status.returncode == 0, status.stdout + status.stderr
        # Host to host, as replication and the agreement go: from host 0's
        # namespace to host 1's replicator, and back.
        machine = json.loads((base / "cluster.json").read_text())["machine"]
        hosts, tag = machine["hosts"], machine["tag"]
        assert {f"mtc{tag}h0", f"mtc{tag}h1"} <= _netns_names()  # seen from out here
        for a, b in ((0, 1), (1, 0)):
            # Into the host's namespace through its sidecar (namespaces made under
            # `ip netns exec` are not mounted by name out here).
            probe = sh("nsenter", f"--target={hosts[a]['sidecar_pid']}", "--net", "--",
                       sys.executable, "-c",
                       "import socket, sys\n"
                       "socket.create_connection((sys.argv[1], int(sys.argv[2])), 3).close()",
                       hosts[b]["address"], str(hosts[b]["replicator_port"]), check=False)
            assert probe.returncode == 0, f"host {a} cannot reach host {b}: {probe.stderr}"
    finally:
        down = sh(*inside, "down", "--base", str(base), check=False, timeout=120)
        shutil.rmtree(base, ignore_errors=True)
    assert down.returncode == 0, down.stderr
    # The cluster's namespaces are gone with it (only its own: the other lane's
    # clusters come and go meanwhile).
    assert tag is not None
    assert {n for n in _netns_names() if n.startswith(f"mtc{tag}")} == set()


def _netns_names() -> set[str]:
    return {line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines()
            if line.strip()}
