"""What the replicators report, and waits on it: a test waits on a condition, never a sleep.

The conditions are pure functions of the replicators' inventories
(:func:`unreplicated`); the waits ask every running replicator (``GetInventory``,
as ``mtc status`` does) until they hold. One definition of a replicated step for
mtc.testing, the benchmarks, the chaos run and the tests' harnesses: every host's
data of it held on each host its replicator copies it to (``targets``: its peer
in the next slice, the same in-slice index, with ``--replicas 1``, the local
cluster's), the copy a restore of that host falls back on. Any host of another
slice is not enough: only the peer group can stand in for a host on restore.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from mtc import replicas as tier
from mtc.errors import MtcError

# Where a host's steps are copied: one rule, the replicators' own. Its home is the
# replicator's configuration until the definitions both sides share move to mtc/.
from mtc.placement import targets
from mtc.testing.waits import POLL_S, timed_wait, wait_until

if TYPE_CHECKING:
    from mtc.proto import replicator_pb2 as pb

Copy = tuple[int, int, int]  # (holder, origin host, step)


def peer_copies(step: int, num_hosts: int, hosts_per_slice: int,
                replicas: int = 1) -> set[Copy]:
    """The copies that make ``step`` replicated: each host's on each of its targets."""
    return {(t, o, step) for o in range(num_hosts)
            for t in targets(o, num_hosts, hosts_per_slice, replicas)}


def unreplicated(held: Collection[Copy], step: int, num_hosts: int,
                 hosts_per_slice: int) -> list[int]:
    """The hosts whose data of ``step`` is missing on one of their targets (``held``:
    the (holder, origin, step) copies the replicators hold)."""
    missing = peer_copies(step, num_hosts, hosts_per_slice) - set(held)
    return sorted({o for _, o, _ in missing})


def wait_replicated(held: Callable[[], Collection[Copy]], step: int, num_hosts: int,
                    hosts_per_slice: int, timeout: float, poll_s: float = POLL_S,
                    silent: Callable[[], Collection[int]] | None = None) -> float:
    """Until ``held()`` (the (holder, origin, step) copies the replicators hold now)
    has every host's peer copy of ``step``; returns the seconds waited. TimeoutError,
    naming the copies missing, after ``timeout`` seconds (and ``silent()``: the hosts
    whose replicator does not answer, the likely cause)."""
    want = peer_copies(step, num_hosts, hosts_per_slice)
    missing = want

    def replicated() -> bool:
        nonlocal missing
        missing = want - set(held())
        return not missing

    def detail() -> str:
        down = sorted(silent()) if silent is not None else []
        return (f"step {step} of hosts {sorted({o for _, o, _ in missing})} is not on its "
                f"peer: missing (holder, origin, step) {sorted(missing)}"
                + (f"; host(s) {down} answer nothing: down, or their replicator is"
                   if down else ""))

    return timed_wait(f"step {step} on every host's peer", replicated, timeout, poll_s=poll_s,
                      detail=detail)


def wait_backed_up(ask_backup: Callable[[], list[int]], step: int, timeout: float) -> None:
    listed: list[int] = []

    def backed_up() -> bool:
        nonlocal listed
        listed = ask_backup()
        return step in listed

    wait_until(f"step {step} in the backup", backed_up, timeout,
               detail=lambda: f"it holds {listed}")


def _inventory(address: str, rank: int, token: str) -> pb.Inventory | None:
    try:
        return tier.inventory(address, token=token, rank=rank)
    except MtcError:
        return None  # down, or not serving yet: the wait asks again


def held(address: str, rank: int, token: str) -> set[tuple[int, int]] | None:
    """The (origin, step) copies the replicator at ``address`` holds (None: no answer)."""
    inv = _inventory(address, rank, token)
    return None if inv is None else {(c.origin_rank, c.step) for c in inv.copies}


def backed_up(address: str, rank: int, token: str) -> list[int]:
    """The steps complete in the backup, as the replicator at ``address`` lists them."""
    inv = _inventory(address, rank, token)
    return [] if inv is None else sorted(inv.backed_up_steps)


def request_backup(address: str, token: str, timeout: float = 600.0) -> int:
    """Back up the newest complete step now (``mtc backup``); returns it (-1: none)."""
    return tier.request_backup(address, token=token, timeout_s=timeout)
