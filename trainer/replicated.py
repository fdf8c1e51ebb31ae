"""Waiting until a step is replicated: every host's data of it held by its peer in
the other slice (the host ``hosts_per_slice`` ranks on), as the replicators place
one peer copy (``--replicas 1``, their default).

One definition for the benchmarks, the chaos run's harness and the tests'
harnesses; each reads what its replicators hold its own way (``held``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

Copy = tuple[int, int, int]  # (holder, origin, step)


def peer_copies(step: int, num_hosts: int, hosts_per_slice: int) -> set[Copy]:
    """The (holder, origin, step) of every host's peer copy of ``step``."""
    return {((o + hosts_per_slice) % num_hosts, o, step) for o in range(num_hosts)}


def wait_replicated(held: Callable[[], Collection[Copy]], step: int, num_hosts: int,
                    hosts_per_slice: int, timeout: float, poll_s: float = 0.1) -> float:
    """Until ``held()`` (the (holder, origin, step) copies the replicators hold now)
    has every host's peer copy of ``step``; returns the seconds waited. TimeoutError,
    naming the copies missing, after ``timeout`` seconds."""
    want = peer_copies(step, num_hosts, hosts_per_slice)
    t0 = time.monotonic()
    while True:
        missing = want - set(held())
        if not missing:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"step {step} not replicated in {timeout}s: missing "
                               f"(holder, origin, step) {sorted(missing)}")
        time.sleep(poll_s)
