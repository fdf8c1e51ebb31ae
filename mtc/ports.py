"""Ports for processes one host (or the local cluster) starts on its own addresses:
a host's sidecar, the local cluster and mtc.testing's jobs take theirs here.

A port taken from the kernel's ephemeral range (``bind(0)``) and released is free only
for a moment: any outgoing connection on the machine may take it as its source port
before the server that was meant to bind it does, or rebinds it after a restart. Ports
here come from below that range, where the kernel never puts an outgoing connection.
"""

from __future__ import annotations

import itertools
import random
import socket
import threading
from pathlib import Path

# Below the ephemeral range and clear of the well-known and registered-service ports
# that lie low in it; the deploy's fixed ports (7000s) are under this floor.
_FLOOR = 20000
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_lock = threading.Lock()
_given: set[tuple[str, int]] = set()  # handed out by this process: never twice


def _ceiling() -> int:
    """The first port the kernel may hand an outgoing connection (Linux's default 32768)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(address: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, port))  # no SO_REUSEADDR: a port in TIME_WAIT is skipped too
        except OSError:
            return False
    return True


def free_ports(n: int, address: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports on ``address`` that nothing binds now, outside the ephemeral
    range so that they stay free until used (and across a restart of what binds them).
    Random, so that test runs sharing a machine rarely pick the same ones."""
    low, high = _FLOOR, _ceiling()
    if high - low < n:  # an unusual ephemeral range: fall back to the kernel's pick
        low, high = 0, 0
    rng = random.Random()
    picked: list[int] = []
    with _lock:
        for _ in range(n):
            # Random tries, then every port in order: a crowded range still yields
            # whatever is free in it.
            tries = (itertools.chain((rng.randrange(low, high) for _ in range(64)),
                                     range(low, high)) if high
                     else (_kernel_pick(address) for _ in range(64)))
            for port in tries:
                if (address, port) not in _given and _bindable(address, port):
                    break
            else:
                raise OSError(f"no free port on {address} in [{low}, {high})")
            _given.add((address, port))
            picked.append(port)
    return picked


def _kernel_pick(address: str) -> int:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
