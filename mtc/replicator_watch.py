"""A manager's watch over its own hosts' replicators.

At start (:meth:`ReplicatorWatch.start`): each local host's replicator must be
the rank the job states and serve this host's RAM disk, else ``ConfigError``
naming both (the host side writes an identity file at the root; the replicator
reports what it finds at its ``--local-dir``: no path crosses between hosts). A
replicator that does not answer is a WARNING, not an error: a replicator late to
start is waited for by the restore, and saves go on.

At each save (:meth:`ReplicatorWatch.poll`): a check in the background when
one is due (never on the save's path: a dead replicator's address may take a
deadline to fail). A host whose replicator stopped answering, cannot reach a
peer (nobody answers at an address of its ``--nodes``: at once, not when
replication is late), or whose steps have not reached its peers for longer than
the replicator's ``--replication-warn-seconds``, is a WARNING in this log as soon
as the check finds it; the hosts without a live replicator are returned by the next save's
poll, and the manager keeps their RAM disks within ``max_to_keep`` itself
(nobody else cleans them meanwhile).

The controller's thread calls it; its one checking thread (which alone writes
the warning records and :attr:`down`, a frozenset swapped whole) is joined by
:meth:`close`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING

from mtc.errors import ConfigError
from mtc.pool import ThreadPool

if TYPE_CHECKING:
    from mtc.credentials import Credentials
    from mtc.proto import replicator_pb2 as pb
    from mtc.sidecar.replicator.wire.client import PeerClient

log = logging.getLogger("mtc.manager")
ASK_DEADLINE_S = 2.0  # a replicator on its own host answers its identity in ms
CHECK_INTERVAL_S = 2.0  # background checks start at most this often (one at a time)


@dataclasses.dataclass(frozen=True)
class Seen:
    """One host's replicator, as a check found it: its identity, or why none came."""

    host: int
    address: str
    rank: int  # the rank the job states for it
    identity: pb.Inventory | None
    error: str = ""


def mismatch(seen: Seen, root: str, root_id: str, subdirs: bool) -> str:
    """Why ``seen``'s replicator is not this host's (it is another rank, or serves
    another folder than ``root``, whose identity is ``root_id``); "" when it is, or
    did not answer, or is too old to say. Pure."""
    ident = seen.identity
    if ident is None or not ident.config.nodes:
        return ""
    if ident.rank != seen.rank:
        return (f"host {seen.host}'s replicator at {seen.address} is rank {ident.rank}, the "
                f"job states rank {seen.rank} (Options.replicator_ranks, in host order)")
    if ident.root_id != root_id:
        other = ("the folder above it" if subdirs else "a host-<i> folder beside it")
        return (f"host {seen.host}'s steps are saved in {root}, but its replicator at "
                f"{seen.address} (rank {seen.rank}) serves another folder "
                f"({'a different RAM disk' if ident.root_id else 'no manager writes there'}): "
                f"start it with --local-dir {root}, or if it serves {other}, set "
                f"Options(host_subdirs={not subdirs})")
    return ""


class ReplicatorWatch:
    """The replicators of the hosts this process serves (``addresses`` and the
    ``ranks`` the job states, by host)."""

    def __init__(self, addresses: Mapping[int, str], ranks: Mapping[int, int],
                 creds: Credentials) -> None:
        from mtc.sidecar.replicator.wire.client import PeerClient

        self._clients: dict[int, PeerClient] = {
            h: PeerClient(a, creds, rank=ranks[h], deadline_s=ASK_DEADLINE_S)
            for h, a in addresses.items()}
        self._pool = ThreadPool(1, "mtc-replicator-watch", lazy=True)
        self._pending: Future[None] | None = None
        self._last = time.monotonic()
        self.down: frozenset[int] = frozenset()
        self._late_warned: dict[int, int] = {}  # host -> the step warned of, while late
        self._config_warned: dict[int, str] = {}  # host -> the disagreement last warned of
        self._peers_warned: dict[int, frozenset[int]] = {}  # host -> peers last warned of

    def start(self, roots: Mapping[int, str], root_ids: Mapping[int, str], *,
              subdirs: bool) -> None:
        """Check now that each replicator is this host's: ``ConfigError`` when one is
        another rank or serves another folder; a WARNING when one does not answer."""
        seen = self._ask_all()
        problems = [p for s in seen
                    if (p := mismatch(s, roots[s.host], root_ids.get(s.host, ""), subdirs))]
        if problems:
            raise ConfigError("; ".join(problems))
        self._note(seen)

    def poll(self) -> frozenset[int]:
        """At a save: start the next check when one is due (it warns as it finds);
        the hosts whose replicator did not answer the last one."""
        idle = self._pending is None or self._pending.done()
        if idle and time.monotonic() - self._last >= CHECK_INTERVAL_S:
            self._last = time.monotonic()
            self._pending = self._pool.submit(self._check)
        return self.down

    def _check(self) -> None:
        self._note(self._ask_all())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for c in self._clients.values():
            c.close()

    def _ask_all(self) -> list[Seen]:
        hosts = list(self._clients)
        if len(hosts) <= 4:  # one process per host, or a few simulated ones
            return [self._ask(h) for h in hosts]
        # One controller serving many hosts (Pathways): a bounded fan-out.
        with ThreadPool(min(16, len(hosts)), "mtc-ask", lazy=True) as pool:
            return list(pool.map(self._ask, hosts))

    def _ask(self, host: int) -> Seen:
        from mtc.grpc_errors import PeerError
        from mtc.proto import replicator_pb2 as pb

        c = self._clients[host]
        try:
            ident = c.call("GetInventory", pb.InventoryRequest(identify=True), attempts=1)
            return Seen(host, c.address, c.rank, ident)
        except PeerError as e:
            return Seen(host, c.address, c.rank, None, e.message)

    def _note(self, seen: list[Seen]) -> None:
        down = frozenset(s.host for s in seen if s.identity is None)
        for s in seen:
            if s.identity is None and s.host not in self.down:
                log.warning("mtc: host %d's replicator at %s does not answer (%s): its saves "
                            "are not copied to a peer nor backed up, and this manager keeps "
                            "its RAM disk within max_to_keep until it is back", s.host,
                            s.address, s.error)
            elif s.identity is not None and s.host in self.down:
                log.info("mtc: host %d's replicator at %s answers again", s.host, s.address)
            if s.identity is not None:
                self._note_late(s)
        self.down = down

    def _note_late(self, s: Seen) -> None:
        ident = s.identity
        assert ident is not None
        if ident.config_error and self._config_warned.get(s.host) != ident.config_error:
            self._config_warned[s.host] = ident.config_error
            log.warning("mtc: host %d's replicator at %s refuses to work: %s", s.host,
                        s.address, ident.config_error)
        self._note_peers(s)
        # Once while it stays late (a job saving on while nothing reaches the peer
        # changes the step waiting at every save), again once it caught up.
        if not ident.replication_late:
            self._late_warned.pop(s.host, None)
        elif s.host not in self._late_warned:
            self._late_warned[s.host] = ident.unreplicated_step
            log.warning("mtc: host %d's steps are not replicated: step %d has waited %.0fs for "
                        "its peers (replicator at %s); losing this host now loses them",
                        s.host, ident.unreplicated_step, ident.unreplicated_seconds, s.address)

    def _note_peers(self, s: Seen) -> None:
        """A WARNING when a host's replicator cannot reach a peer (a wrong address in
        its --nodes: nobody answers there), once per set of such peers; INFO when it
        reaches them all again."""
        ident = s.identity
        assert ident is not None
        faults = list(ident.unanswered_peers)
        cut = frozenset(p.rank for p in faults)
        if cut == self._peers_warned.get(s.host, frozenset()):
            return
        self._peers_warned[s.host] = cut
        if not cut:
            log.info("mtc: host %d's replicator at %s reaches every peer again", s.host,
                     s.address)
            return
        for p in faults:
            log.warning("mtc: host %d's replicator at %s cannot reach rank %d at %s (no answer "
                        "for %.0fs: %s)%s; if that address is wrong, fix its --nodes (mtc "
                        "status names it too)", s.host, s.address, p.rank, p.address,
                        p.seconds, p.error,
                        ": this host's steps are not copied to a peer, a loss of this host "
                        "loses them" if p.target else "")
