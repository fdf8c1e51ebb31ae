"""The local cluster's network with root: a namespace per host on a bridge of its own.

The bridge lives in a namespace of the cluster's own (the "switch"), joined to the
caller's namespace by one link (this side ``<subnet>.1``, the hosts' gateway), so
traffic between hosts never crosses the caller's firewall. Each host's namespace
has one port on the bridge; a link cut takes that port down, a partition adds
blackhole routes inside the hosts' namespaces. Only the cluster's own private
/24 is ever addressed. Names come from :class:`mtc.testing.isolation.Hosts`
(one tag per cluster), and :func:`remove` takes everything away.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Sequence


def run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def uplink(tag: str) -> tuple[str, str]:
    """The uplink's two ends: in the caller's namespace, and in the switch."""
    return f"mtu{tag}a", f"mtu{tag}b"


def host_port(tag: str, host: int) -> tuple[str, str]:
    """A host's link: its port on the bridge (in the switch), and its own end."""
    return f"mtv{tag}{host}a", f"mtv{tag}{host}b"


def make_switch(tag: str, switch: str, bridge: str, subnet: str) -> None:
    """The switch namespace with its bridge, and the uplink from this namespace."""
    here, there = uplink(tag)
    run("ip", "netns", "add", switch)
    run("ip", "-n", switch, "link", "set", "lo", "up")
    run("ip", "-n", switch, "link", "add", bridge, "type", "bridge")
    run("ip", "-n", switch, "link", "set", bridge, "up")
    run("ip", "link", "add", here, "type", "veth", "peer", "name", there, "netns", switch)
    run("ip", "-n", switch, "link", "set", there, "master", bridge)
    run("ip", "-n", switch, "link", "set", there, "up")
    run("ip", "addr", "add", f"{subnet}.1/24", "dev", here)
    run("ip", "link", "set", here, "up")


def add_host(tag: str, switch: str, bridge: str, host: int, netns: str, address: str) -> None:
    """Host ``host``'s namespace, at ``address`` on the bridge."""
    outer, inner = host_port(tag, host)
    run("ip", "netns", "add", netns)
    run("ip", "-n", switch, "link", "add", outer, "type", "veth", "peer", "name", inner,
        "netns", netns)
    run("ip", "-n", switch, "link", "set", outer, "master", bridge)
    run("ip", "-n", switch, "link", "set", outer, "up")
    for cmd in (("addr", "add", f"{address}/24", "dev", inner),
                ("link", "set", inner, "up"), ("link", "set", "lo", "up")):
        run("ip", "-n", netns, *cmd)


def set_link(tag: str, switch: str, host: int, up: bool) -> None:
    run("ip", "-n", switch, "link", "set", host_port(tag, host)[0], "up" if up else "down")


def remove(tag: str, switch: str, netns: Sequence[str]) -> None:
    """The hosts' namespaces, the switch (the bridge and every port go with it) and
    the uplink; what is already gone is skipped."""
    for cmd in (*[["ip", "netns", "del", ns] for ns in netns],
                ["ip", "netns", "del", switch], ["ip", "link", "del", uplink(tag)[0]]):
        subprocess.run(cmd, capture_output=True, check=False)


class Blackholes:
    """Routes that drop what a host's namespace sends to an address (partitions)."""

    def __init__(self) -> None:
        self._routes: list[tuple[str, str]] = []  # (namespace, address)

    def add(self, netns: str, address: str) -> None:
        if (netns, address) not in self._routes:
            run("ip", "-n", netns, "route", "add", "blackhole", f"{address}/32")
            self._routes.append((netns, address))

    def clear(self) -> None:
        while self._routes:
            ns, addr = self._routes.pop()
            subprocess.run(["ip", "-n", ns, "route", "del", "blackhole", f"{addr}/32"],
                           capture_output=True, check=False)


_PROBE = ("import socket, sys\n"
          "bad = []\n"
          "for a in sys.argv[2:]:\n"
          "    h, p = a.rsplit(':', 1)\n"
          "    try:\n"
          "        socket.create_connection((h, int(p)), float(sys.argv[1])).close()\n"
          "    except OSError as e:\n"
          "        bad.append(f'{a} ({e})')\n"
          "print('; '.join(bad))\n")


def check_reach(targets: dict[int, tuple[str, str]], switch: str, subnet: str,
                timeout_s: float) -> None:
    """Every host (``targets``: index -> (its namespace, its ``address:port``))
    reaches every other (a TCP connect from inside its namespace), and this
    namespace reaches each, or a RuntimeError within seconds naming the hosts
    that cannot and the likely cause."""
    checks = {i: subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", _PROBE, str(timeout_s),
         *[t for j, (_, t) in targets.items() if j != i]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i, (ns, _) in targets.items()}
    problems = []
    for i, proc in checks.items():
        out, err = proc.communicate(timeout=timeout_s * len(targets) + 30)
        if proc.returncode != 0 or out.strip():
            problems.append(f"host {i} ({targets[i][1].rsplit(':', 1)[0]}) cannot reach "
                            f"{out.strip() or err.strip()[-300:]}")
    for i, (_, t) in targets.items():
        host, port = t.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout_s).close()
        except OSError as e:
            problems.append(f"this namespace cannot reach host {i} at {t} ({e})")
    if problems:
        raise RuntimeError(
            "the local cluster's hosts cannot reach each other: " + "; ".join(problems)
            + f". Their traffic crosses only the cluster's own namespaces ({switch} "
            "and the hosts'): look for a firewall or route inside them, or a subnet "
            f"({subnet}.0/24) that this machine already uses")
