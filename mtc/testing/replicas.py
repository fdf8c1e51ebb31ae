"""What the replicators report, and waits on it: a test waits on a condition, never a sleep.

The conditions are pure functions of the replicators' inventories
(:func:`unreplicated`, :func:`missing_backup`); the waits ask every running
replicator (``GetInventory``, as ``mtc status`` does) until they hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.client import PeerClient, PeerError
from mtc.sidecar.replicator.security import Credentials

POLL_S = 0.05  # between two rounds of inventories: a few small RPCs per host

# Per host, the (origin host, step) copies its replicator holds; None: it does not run.
Ask = Callable[[int], set[tuple[int, int]] | None]


def unreplicated(held: Mapping[int, set[tuple[int, int]]], step: int,
                 slice_of: Sequence[int]) -> list[int]:
    """The hosts whose data of ``step`` no host of another slice holds."""
    return [o for o in range(len(slice_of))
            if not any((o, step) in copies for h, copies in held.items()
                       if slice_of[h] != slice_of[o])]


def wait_replicated(ask: Ask, step: int, slice_of: Sequence[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        held = {h: got for h in range(len(slice_of)) if (got := ask(h)) is not None}
        missing = unreplicated(held, step, slice_of)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} of hosts {missing} has no copy in another "
                               f"slice after {timeout}s")
        time.sleep(POLL_S)


def wait_backed_up(ask_backup: Callable[[], list[int]], step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while step not in (listed := ask_backup()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} not in the backup after {timeout}s "
                               f"(it holds {listed})")
        time.sleep(POLL_S)


def _inventory(address: str, rank: int, token: str) -> pb.Inventory | None:
    client = PeerClient(address, Credentials(token=token), rank=rank, deadline_s=5.0)
    try:
        inv: pb.Inventory = client.call("GetInventory", pb.InventoryRequest(), attempts=1)
        return inv
    except PeerError:
        return None  # down, or not serving yet: the wait asks again
    finally:
        client.close()


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
    client = PeerClient(address, Credentials(token=token), rank=-1)
    try:
        reply = client.call("RequestBackup", pb.BackupRequest(step=-1), deadline_s=timeout,
                            attempts=1)
    finally:
        client.close()
    return int(reply.step)
