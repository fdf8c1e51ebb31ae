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

import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from mtc import replicas as tier
from mtc.errors import MtcError, PeerError

# Where a host's steps are copied: one rule, the replicators' own. Its home is the
# replicator's configuration until the definitions both sides share move to mtc/.
from mtc.placement import targets
from mtc.testing.waits import POLL_S, timed_wait, wait_until

if TYPE_CHECKING:
    from mtc.credentials import Credentials
    from mtc.proto import replicator_pb2 as pb
    from mtc.testing.isolation import Hosts

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


def health(address: str, creds: Credentials | None = None, timeout_s: float = 1.0) -> str:
    """What the gRPC health service at ``address`` says of the whole server
    (``SERVING``, ``NOT_SERVING``), or the gRPC code of a call it did not answer
    (``UNAVAILABLE``); ``creds``: mutual TLS (none: plaintext, as the replicators'
    health mirror)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cc = creds.channel_credentials() if creds else None
    channel = grpc.secure_channel(address, cc) if cc else grpc.insecure_channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=timeout_s)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    except grpc.RpcError as e:
        return str(e.code().name)
    finally:
        channel.close()


def wait_healthy(address: str, alive: Callable[[], bool], creds: Credentials | None,
                 log: Callable[[], str], timeout: float = 30.0, *, want: str = "SERVING",
                 ready: Callable[[], bool] | None = None, poll_s: float = POLL_S) -> None:
    """Until the replicator at ``address`` answers its health check ``want``
    (``NOT_SERVING``: a stalled loop): every harness's "until serving". A
    RuntimeError with its ``log`` as soon as it is not ``alive``; a
    :class:`~mtc.testing.waits.WaitTimeout` after ``timeout`` seconds naming what
    it answered last. ``ready``: asked first, a cheaper sign (a port file's stat)
    before any RPC."""
    got = ""

    def answers() -> bool:
        nonlocal got
        if ready is not None and not ready():
            return False
        got = health(address, creds)
        return got == want

    def up() -> None:
        if not alive():
            raise RuntimeError(f"replicator at {address} exited: {log()}")

    up()
    wait_until(f"replicator at {address} health {want}", answers, timeout, poll_s=poll_s,
               during=up, detail=lambda: f"it answers {got or 'nothing yet'}: {log()}")


class Replicators:
    """What a cluster of replicators reports, and the waits on it, whoever hosts them:
    ``mtc.sidecar.replicator.memory_cluster.MemoryCluster`` (in one process),
    :class:`HostReplicators` (each a process on an isolated host) and
    ``tests/replicators.Cluster`` (each a process on a plain folder) give
    :meth:`alive`, :meth:`inventory`, :meth:`scrape` and :meth:`log_text`; the
    copies held, the loop's passes and the waits on them are defined once, here."""

    n: int
    per_slice: int

    def alive(self, rank: int) -> bool:
        raise NotImplementedError

    def inventory(self, rank: int) -> pb.Inventory:
        """What rank ``rank`` shows a peer (its GetInventory)."""
        raise NotImplementedError

    def scrape(self, rank: int) -> dict[str, float]:
        """Rank's metrics as a scrape reads them: ``name`` or ``name{label=v,...}``."""
        raise NotImplementedError

    def log_text(self, rank: int) -> str:
        """Rank's log, for a failed wait's report ("" when it keeps none)."""
        return ""

    def held(self) -> set[Copy]:
        """(holder, origin, step) for every complete copy on every running replicator
        that answers (one not serving yet, as an Orbax-mode one until its client names
        its rank, or one cut off, is asked again at a wait's next poll)."""
        out: set[Copy] = set()
        unanswered = []
        for r in range(self.n):
            if self.alive(r):
                try:
                    inv = self.inventory(r)
                except PeerError:
                    unanswered.append(r)
                    continue
                out |= {(r, c.origin_rank, c.step) for c in inv.copies}
        self._unanswered = unanswered
        return out

    def silent(self) -> list[int]:
        """The ranks whose replicator is down, or did not answer the last :meth:`held`."""
        return sorted({r for r in range(self.n) if not self.alive(r)}
                      | set(getattr(self, "_unanswered", ())))

    def passes(self, rank: int, loop: str = "replication") -> int:
        """Passes rank's ``loop`` (replication, backup) finished without failing since
        its replicator started."""
        return int(self.scrape(rank).get(f"mtc_loop_passes_total{{loop={loop}}}", 0))

    def wait_held(self, want: set[Copy], timeout: float = 60.0) -> None:
        """Until every (holder, origin, step) in ``want`` is held."""
        missing = want

        def holds() -> bool:
            nonlocal missing
            missing = want - self.held()
            return not missing

        def detail() -> str:
            first = min(missing)[0]  # its holder's log says why, when it keeps one
            return f"missing (holder, origin, step) {sorted(missing)}: " \
                   f"{self.log_text(first)[-2000:]}"

        wait_until(f"copies held: {sorted(want)}", holds, timeout, detail=detail)

    def wait_replicated(self, step: int, timeout: float = 60.0) -> None:
        """Until every host's ``step`` is held by its peer (mtc.testing's condition,
        the one users' tests wait on)."""
        wait_replicated(self.held, step, self.n, self.per_slice, timeout, silent=self.silent)

    def wait_passes(self, *ranks: int, loop: str = "replication", more: int = 2,
                    timeout: float = 30.0) -> None:
        """Until each of ``ranks``' ``loop`` has finished ``more`` passes after this
        call. With two, at least one whole pass began after it (the first may have
        been under way): what a test waits on before asserting that the loop did
        *not* do something, instead of sleeping for a time a loaded machine may not
        honour."""
        want = {r: self.passes(r, loop) + more for r in ranks}
        deadline = time.monotonic() + timeout
        for r, n in want.items():
            self._wait_passes(r, loop, n, max(0.0, deadline - time.monotonic()))

    def _wait_passes(self, rank: int, loop: str, n: int, timeout: float) -> None:
        wait_until(f"rank {rank}'s {loop} loop passing {n} times",
                   lambda: self.passes(rank, loop) >= n, timeout,
                   detail=lambda: f"{self.passes(rank, loop)} passes: "
                                  f"{self.log_text(rank)[-2000:]}")

    def wait_sample(self, rank: int, sample: str, at_least: float,
                    timeout: float = 30.0) -> None:
        """Until rank's ``sample`` (as :meth:`scrape` names it) is at least ``at_least``
        (a replicator not serving it yet counts as below): e.g. ``mtc_restores_waiting``
        1, a restore it serves waits for its coordinator's decision."""
        got: list[float | None] = [None]

        def reached() -> bool:
            with contextlib.suppress(OSError):
                got[0] = self.scrape(rank).get(sample)
            return got[0] is not None and got[0] >= at_least

        wait_until(f"rank {rank}'s {sample} at least {at_least}", reached, timeout,
                   detail=lambda: f"it is {got[0]}: {self.log_text(rank)[-2000:]}")


class HostReplicators(Replicators):
    """Replicator processes on isolated hosts (:class:`mtc.testing.isolation.Hosts`),
    at ``addresses`` (rank r's at ``addresses[r]``), ``per_slice`` hosts a slice:
    what they hold asked over the network as ``mtc status`` asks it (the hosts'
    token, or ``creds``), their logs read from the hosts' folders. The harnesses
    that start replicators on such hosts (the multi-controller jobs', the Orbax
    client's, the network faults') take their waits from here, as the in-memory
    cluster and the plain process cluster do from :class:`Replicators`."""

    def __init__(self, hosts: Hosts, addresses: Sequence[str], per_slice: int, *,
                 creds: Credentials | None = None) -> None:
        self.hosts = hosts
        self.addrs = list(addresses)  # none: the hosts run no replicator
        self.n = len(hosts.hosts)
        self.per_slice = per_slice
        self.creds = creds

    def alive(self, rank: int) -> bool:
        return self.hosts.replicator_alive(rank)

    def inventory(self, rank: int) -> pb.Inventory:
        return tier.inventory(self.addrs[rank], token=self.hosts.token(), creds=self.creds,
                              rank=rank)

    def log_text(self, rank: int) -> str:
        return self.hosts.log_tail(rank, "replicator", 1 << 20)
