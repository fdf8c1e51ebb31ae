"""A replicator's part in the restore agreement (``docs/agreement.md``; the
protocol's pure parts and its decider are ``agreement.py``).

Every node of the job's stated membership asks its coordinator (the lowest
member; rank 0 for a job of full size) which step to restore; the coordinator
gathers every member's holdings and records the epoch's step once, only when
every member answered; every node reads that record and fences off its own
steps newer than it. When a member does not answer within the deadline nobody
restores: a typed :class:`~mtc.errors.AgreementError`.

This module owns the book of decisions, the coordinators (one per membership
stated), the newest decision read, and the inventory fan-out, on the pool its
node hands it (never behind a restore's file fetches). It starts no thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import grpc

from mtc.errors import AgreementError, ConfigError, InvalidStepError, MtcError, ProtocolError
from mtc.grpc_errors import PeerError, is_retryable
from mtc.lifecycle import Threads
from mtc.pool import ThreadPool
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator import checks
from mtc.sidecar.replicator.agree.agreement import Coordinator
from mtc.sidecar.replicator.agree.attest import said_of
from mtc.sidecar.replicator.agree.book import BOOK_NAME, Book, Decision
from mtc.sidecar.replicator.agree.decision import (
    Holding,
    check_members,
    newest_complete_run,
    refused,
)
from mtc.sidecar.replicator.agree.decision import gc_keeps as keeps_of
from mtc.sidecar.replicator.agree.fresh import Fresh
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.copies.provenance import ProofCheck
from mtc.sidecar.replicator.metrics import Metrics
from mtc.sidecar.replicator.store.fence import fences_on
from mtc.sidecar.replicator.store.store import LocalStore
from mtc.sidecar.replicator.transport import Peer

log = logging.getLogger(__name__)
# The longest one Decide call lasts before the same ask goes again (``_ask``).
DECIDE_CALL_S = 5.0
Inventory = Callable[[bool], pb.Inventory]  # this node's own, with (True) or without files


def holding_of(inv: pb.Inventory, repaired: Sequence[pb.StepCopy] = ()) -> Holding:
    """What the agreement needs of an inventory (no file lists); ``repaired``: its
    damaged own steps that count as held (see :func:`repairable`)."""
    d = inv.last_decision
    last = (Decision(d.epoch, d.step, d.decided_at, inv.rank, d.restore_id)
            if d.epoch > 0 else None)
    copies = [*inv.copies, *repaired]
    return Holding(frozenset((c.origin_rank, c.step) for c in copies),
                   frozenset(inv.backed_up_steps), last,
                   frozenset((c.step, c.saved_hosts) for c in copies
                             if c.saved_hosts and not c.run),
                   frozenset((c.origin_rank, c.step, c.run, c.saved_hosts)
                             for c in copies if c.run),
                   frozenset((c.step, c.run, tuple(c.saving_ranks))
                             for c in copies if c.saving_ranks),
                   said_of(copies))


def repairable(invs: Mapping[int, pb.Inventory]) -> dict[int, list[pb.StepCopy]]:
    """Per holder, its damaged own steps (``Inventory.damaged``) whose every bad file
    some inventory's verified copy of the same step and run holds: the same path,
    size and CRC32C (a data-parallel twin's shard, saved by another replica). A
    restore heals those in place from it, so they count as held and a step is not
    given up for them. ``invs`` with file lists. Pure."""
    have: dict[tuple[int, str], set[tuple[str, int, int]]] = defaultdict(set)
    for inv in invs.values():
        for c in inv.copies:
            have[(c.step, c.run)].update((f.path, f.size, f.crc32c) for f in c.files)
    out: dict[int, list[pb.StepCopy]] = {}
    for holder, inv in invs.items():
        ok = [d for d in inv.damaged if d.files and all(
            (f.path, f.size, f.crc32c) in have.get((d.step, d.run), ()) for f in d.files)]
        if ok:
            out[holder] = ok
    return out


def holders_of(invs: Mapping[int, pb.Inventory], run: str | None = None
               ) -> dict[tuple[int, int], list[tuple[int, pb.StepCopy]]]:
    """(origin, step) -> [(holder rank, its copy)]; ``run``: copies written by that
    run only (a copy of another run under the same number is another checkpoint)."""
    out: dict[tuple[int, int], list[tuple[int, pb.StepCopy]]] = defaultdict(list)
    for holder, inv in invs.items():
        for c in inv.copies:
            if run is None or c.run == run:
                out[(c.origin_rank, c.step)].append((holder, c))
    return out


class NodeAgreement:
    """One node's agreement: deciding for the memberships it coordinates, asking
    the coordinator of its own, and the inventories both gather. ``inventory``
    is its node's own; ``refuse``: raises while the node's configuration
    disagrees with a peer's. A service (:class:`mtc.lifecycle.Service`): no thread
    of its own; it owns the inventory fan-out's pool, which never waits behind a
    restore's fetches."""

    def __init__(self, config: ReplicatorConfig, root: Path, store: LocalStore,
                 peers: Mapping[int, Peer], metrics: Metrics, *,
                 inventory: Inventory, refuse: Callable[[], None],
                 proofs: ProofCheck | None = None) -> None:
        self.config = config
        # With mutual TLS: a peer's copies of other ranks' data count only proven.
        self.proofs = proofs
        self._unproven_told: set[str] = set()  # what was logged (once each)
        self.rank = config.rank
        self.store = store
        self.peers = peers
        self.metrics = metrics
        self._inventory = inventory
        self._refuse = refuse
        self._stop = threading.Event()
        self._pool = ThreadPool(16, "mtc-inventory", lazy=True)
        self.last_decision = pb.Decision()  # the newest one this node read
        # The restore id this node asks the coordinator for last: an older restore
        # still retrying an unreachable coordinator stops when a newer one starts.
        # An ask of it already on its way is refused by the coordinator, which keeps
        # one ask per rank, the newest by when its restore started (``supersedes``).
        self._asking_rid = ""
        # Every node may decide: a job's decider is the lowest rank of the membership
        # it states, and a job that came back smaller may not include rank 0. One
        # book (epoch numbers past every one it or a member knows), one coordinator
        # per membership stated, created on its first ask (``_lock``).
        self.book = Book(root / BOOK_NAME)
        self._lock = threading.Lock()
        self._coordinators: dict[tuple[int, ...], Coordinator] = {}
        # Members that did not answer the last probe (rank -> why), for the askers'
        # errors: the member that never asks is named with its address.
        self._silent: dict[int, str] = {}
        members = list(range(config.num_nodes))
        self.coordinator = self.coordinator_of(tuple(members))
        # The coordinator's view for GC (the steps it keeps), shared by concurrent askers.
        self.kept = Fresh(lambda: keeps_of(
            self.gather_holdings(members, time.monotonic() + config.deadline_s),
            config.num_nodes, config.equivalent, signed=proofs is not None),
            min_interval_s=config.gc_view_interval_s)

    def start(self, threads: Threads) -> None:
        pass  # no thread: its calls run on its callers' and its pool's

    def stop(self) -> None:
        """Every restore waiting for its decision ends now, typed; asks end."""
        self._stop.set()
        with self._lock:
            coordinators = list(self._coordinators.values())
        for c in coordinators:
            c.close()

    def close(self) -> None:
        """After the servers ended: the inventory pool."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def coordinator_rank(self) -> int:
        """The decider of the full membership (every node): rank 0."""
        return 0

    def coordinator_of(self, members: tuple[int, ...]) -> Coordinator:
        """This node's coordinator of ``members`` (validated, sorted; this node its
        lowest rank). Fixed per membership, never failed over: a decision needs every
        member anyway, the decider included."""
        with self._lock:
            c = self._coordinators.get(members)
            if c is None:
                c = Coordinator(
                    list(members), self.config.equivalent,
                    # Every member asked before the coordinator gathers: each one is up.
                    lambda ranks, deadline: self.gather_holdings(
                        ranks, deadline, known_up=True, among=members),
                    self.book, num_nodes=self.config.num_nodes, faults=self.config_faults,
                    signed=self.proofs is not None,
                    silent=self.silent)
                self._coordinators[members] = c
            return c

    def config_faults(self, ranks: Sequence[int], within_s: float) -> str:
        """How those of ``ranks`` that answer say their configuration disagrees with a
        peer's (their identity's ``config_error``), each named; "" when none does."""
        futs = {r: self._pool.submit(self.peers[r].inventory,
                                     pb.InventoryRequest(identify=True),
                                     deadline_s=min(2.0, self.config.deadline_s, within_s),
                                     attempts=1)
                for r in ranks if r in self.peers}
        faults = []
        for r, fut in futs.items():
            try:
                error = str(fut.result().config_error)[:1000]  # a peer's text: bounded
            except PeerError as e:
                # Not answering is the agreement's own "no request yet": said with it.
                self._silent[r] = (f"rank {r}'s replicator at {self.peers[r].address} does "
                                   f"not answer: {e.code.name if e.code else 'no code'}: "
                                   f"{e.message[:300]}")
                continue
            self._silent.pop(r, None)
            if error:
                faults.append(f"rank {r}'s replicator refuses: {error}")
        return "; ".join(faults)

    def silent(self, ranks: Sequence[int]) -> str:
        """What the last probe found of those members not answering ("": nothing)."""
        return "; ".join(self._silent[r] for r in ranks if r in self._silent)

    # -- inventories ------------------------------------------------------------------

    def gather_invs(self, ranks: Sequence[int], deadline: float, *,
                    known_up: bool = False, up: Collection[int] = (),
                    files: bool = True) -> dict[int, pb.Inventory]:
        """Inventories of those of ``ranks`` that answer before ``deadline``, asked at
        once. ``known_up``: they are serving (see :meth:`.transport.Peer.inventory`); ``up``:
        those of them that are; ``files``: with the copies' file lists."""
        out: dict[int, pb.Inventory] = {}
        futs = {}
        for r in ranks:
            if r == self.rank:
                out[r] = self._inventory(files)
            else:
                left = max(0.05, min(self.config.deadline_s, deadline - time.monotonic()))
                futs[r] = self._pool.submit(self.peers[r].inventory,
                                            pb.InventoryRequest(without_files=not files),
                                            deadline_s=left, attempts=1,
                                            known_up=known_up or r in up)
        for r, fut in futs.items():
            try:
                # Checked whole before anything in it is stored or acted on.
                out[r] = checks.inventory(fut.result(), rank=r,
                                          num_nodes=self.config.num_nodes)
                self._drop_unproven(out[r])
            except PeerError as e:
                self.metrics.skipped.labels("inventory_unanswered").inc()
                log.debug("rank %d: no inventory from rank %d: %s", self.rank, r, e)
            except MtcError as e:
                self.metrics.skipped.labels("inventory_refused").inc()
                log.warning("rank %d: refused the inventory of rank %d: %s", self.rank, r, e)
        return out

    def _drop_unproven(self, inv: pb.Inventory) -> None:
        """Ignore, count and log the copies of other ranks' data ``inv`` lists unproven."""
        gone = self.proofs.drop_unproven(inv) if self.proofs is not None else []
        if gone:
            self.metrics.unproven.inc(len(gone))
            new = set(gone) - self._unproven_told
            # Each said once at WARNING (a gather runs every pass); the set bounded.
            self._unproven_told = (self._unproven_told | new
                                   if len(self._unproven_told) < 1000 else new)
            log.log(logging.WARNING if new else logging.DEBUG,
                    "rank %d: ignored %d copies rank %d lists without a valid proof that "
                    "their origin made them: %s", self.rank, len(gone), inv.rank,
                    "; ".join(gone[:3])[:2000])

    def gather_holdings(self, ranks: Sequence[int], deadline: float, *,
                        known_up: bool = False, among: Sequence[int] = ()
                        ) -> dict[int, Holding]:
        """The holdings of those of ``ranks`` that answer before ``deadline``.
        ``among``: the members whose files may repair a damaged step (a restore's
        decision); without it a damaged step counts for nothing (GC's view keeps
        the older steps until it is healed)."""
        invs = self.gather_invs(ranks, deadline, known_up=known_up, files=False)
        repairs: dict[int, list[pb.StepCopy]] = {}
        # Under mutual TLS a heal takes only bytes that hash as their host signed
        # them, listed with a proven copy of its data elsewhere, which counts as
        # held by itself: another rank's identical files repair nothing then.
        if among and self.proofs is None and any(inv.damaged for inv in invs.values()):
            # Rare (a file found bad with no identical one on its host): the members'
            # file lists say which damaged steps a restore can heal.
            full = self.gather_invs(among, deadline, known_up=known_up, files=True)
            repairs = repairable({**invs, **full})
        return {r: holding_of(inv, repairs.get(r, ())) for r, inv in invs.items()}

    def gather(self, up: Collection[int] = ()) -> dict[int, pb.Inventory]:
        """Every reachable node's inventory (best effort: the data's whereabouts, never
        the decision, which only :meth:`agree_epoch` reads). ``up``: ranks known to
        be serving (the members of an epoch just decided: each one asked), called
        over a connection made now (never skipped for a shared channel's backoff
        from a restart they have just come back from)."""
        return self.gather_invs(range(self.config.num_nodes),
                                time.monotonic() + self.config.deadline_s, up=up)

    def newest_complete_run(self, invs: Mapping[int, pb.Inventory]) -> tuple[int, str]:
        """The newest step whose data is held (on hosts, not in backup) for every rank
        that saved it, and the run whose copies make it."""
        holdings = {r: holding_of(i) for r, i in invs.items()}
        # Under mutual TLS only a step its saving hosts' words carry for every node
        # (a step one host says it saved alone is not backed up as the job's).
        skip = (refused(holdings, range(self.config.num_nodes))
                if self.proofs is not None else {})
        return newest_complete_run(holdings, self.config.num_nodes, self.config.equivalent,
                                   skip=skip)

    def gc_keeps(self) -> frozenset[int] | None:
        """The steps no replicator deletes (``agreement.gc_keeps``: the newest complete
        one, the newest one on two hosts) from inventories gathered after asking (the
        coordinator's :class:`Fresh` view, shared by every node asking at once: one
        message per node, not N); None when the coordinator does not answer, or
        answers nonsense (nothing is deleted on it)."""
        try:
            if self.rank == self.coordinator_rank:
                return self.kept.get(self.config.deadline_s * 2)
            reply = self.peers[self.coordinator_rank].complete(
                deadline_s=self.config.deadline_s * 2)
            return checks.kept(reply, host=self.coordinator_rank)
        except (PeerError, AgreementError) as e:
            log.debug("rank %d: no complete-step view: %s", self.rank, e)
            return None
        except (ProtocolError, InvalidStepError) as e:
            log.warning("rank %d: the coordinator's garbage-collection view: %s", self.rank, e)
            return None

    def complete_steps(self) -> list[int]:
        """The coordinator's answer to ``GetComplete``: the steps it keeps."""
        if self.rank != self.coordinator_rank:
            raise ConfigError(f"rank {self.rank} is not the coordinator")
        return sorted(self.kept.get(self.config.deadline_s * 2))

    # -- deciding and asking ------------------------------------------------------------

    def decide_for(self, rank: int, rid: str, timeout_s: float,
                   members: Sequence[int] = (), started_ns: int = 0,
                   alive: Callable[[], bool] | None = None) -> pb.Decision:
        """The decider's side of ``Decide``: the recorded decision of the epoch of
        ``members`` (empty: every node) that this ask belongs to (``alive``: whether
        the asker's call is still open, ``Coordinator.decide_for``)."""
        if not 0 <= rank < self.config.num_nodes:
            raise ValueError(f"rank {rank} is not a member (0..{self.config.num_nodes - 1})")
        self._refuse()
        group = check_members(members, self.config.num_nodes, rank)
        if self.rank != group[0]:
            raise ConfigError(f"rank {self.rank} is not the agreement coordinator of "
                              f"membership {list(group)} (rank {group[0]} is)")
        rec = self.coordinator_of(group).decide_for(
            rank, rid, min(timeout_s, self.config.agreement_timeout_s), started_ns, alive)
        return pb.Decision(epoch=rec.epoch, step=rec.step, decided_at=rec.decided_at,
                           rank=rank, restore_id=rid, run=rec.run, lost=rec.lost)

    def agree_epoch(self, timeout_s: float | None = None, rid: str = "",
                    members: Sequence[int] = ()) -> pb.Decision:
        """Read this restore's decision from the decider of ``members`` (the job's
        membership as it stated it; empty: every node), deciding it when this node
        is that decider. Raises :class:`AgreementError` at the deadline."""
        # The asker's deadline, never beyond --agreement-timeout-seconds: a member that
        # does not ask fails the restore within that bound, whatever the asker allows.
        timeout = min(timeout_s or self.config.agreement_timeout_s,
                      self.config.agreement_timeout_s)
        deadline = time.monotonic() + timeout
        started_ns = time.time_ns()
        group = check_members(members, self.config.num_nodes, self.rank)
        c = group[0]
        self._asking_rid = rid
        with self.metrics.restores_waiting.track_inprogress():
            if c == self.rank:
                d = self.decide_for(self.rank, rid, timeout, group, started_ns)
            else:
                d = self._ask(c, rid, group, timeout, deadline, started_ns)
        if self._asking_rid != rid:
            # A newer restore on this host began while this ask waited: the job gave
            # this one up, and may have saved since the newer one's decision. Fencing
            # on this answer would delete those saves (it came as late as that once,
            # over gRPC, from a failed restore's ask).
            raise AgreementError("a newer restore on this host replaced this one before "
                                 "its decision came: nothing fenced for it", host=self.rank)
        # Not a re-issued ask of a decision already read (same epoch, same restore id).
        fresh = (d.epoch, d.restore_id) != (self.last_decision.epoch,
                                            self.last_decision.restore_id) or not d.restore_id
        self.last_decision = d
        log.info("rank %d: restore step %d (epoch %d, decided by rank %d)",
                 self.rank, d.step, d.epoch, c)
        if fences_on(d.step, fresh):
            gone = self.store.fence(d.step)
            if gone:
                log.info("rank %d: fenced off steps newer than the agreed step %d (copies "
                         "of (rank, step) %s): they did not finish on every host, and the "
                         "job saves those numbers again", self.rank, d.step, gone)
        elif d.lost:
            log.error("rank %d: no step can be restored although hosts hold data: %s",
                      self.rank, d.lost)
        return d

    def _ask(self, c: int, rid: str, group: Sequence[int], timeout: float,
             deadline: float, started_ns: int) -> pb.Decision:
        """Ask coordinator ``c`` until it answers, the deadline passes, or a newer
        restore on this node takes over. An ask already on its way when that happens
        (queued on a channel still connecting) can reach the coordinator after the
        newer restore's; ``started_ns`` lets the coordinator refuse it.

        Each call lasts at most ``DECIDE_CALL_S``, then the same ask goes again: a
        request or an answer that a cut link lost is asked for again within
        seconds of the heal, not waited for until the deadline. The ask holds its
        place in the epoch until the deadline whichever call carries it."""
        while True:
            left = deadline - time.monotonic()
            if self._asking_rid != rid:
                raise AgreementError("a newer restore on this host replaced this one "
                                     "while the coordinator was unreachable", host=self.rank)
            try:
                # The coordinator answers a second before our deadline, so its typed
                # "cannot decide" reaches us instead of our own timeout.
                req = pb.DecideRequest(rank=self.rank, restore_id=rid,
                                       timeout_seconds=max(0.1, left - 1.0), members=group,
                                       started_ns=started_ns)
                # The ask's own wait ends a second before ``left``. A call is asked
                # again only with more than a second of that wait still to come:
                # else the other members' asks (about the same deadline) could lapse
                # first and be named as missing. Near the end, one call carries it all.
                call_s = max(0.1, left if left <= DECIDE_CALL_S + 2.0 else DECIDE_CALL_S)
                t_call = time.monotonic()
                self.metrics.decide_calls.inc()
                return checks.decision(self.peers[c].decide(req, deadline_s=call_s).decision,
                                       host=c)
            except PeerError as e:
                if e.code == grpc.StatusCode.FAILED_PRECONDITION:  # a configuration fault
                    raise ConfigError(e.message, step=e.step,
                                      host=c if e.host is None else e.host) from e
                if not is_retryable(e) or e.code == grpc.StatusCode.ABORTED or \
                        time.monotonic() + 0.2 >= deadline or self._stop.is_set():
                    said = e.message
                    if e.code in (grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.DEADLINE_EXCEEDED):
                        said = (f"the coordinator, rank {c}'s replicator at "
                                f"{self.peers[c].address}, does not answer: {e.message}")
                    raise AgreementError(f"no restore decision within {timeout:.1f}s: "
                                         f"{said}", step=e.step,
                                         host=self.rank if e.host is None else e.host
                                         ) from e
                if e.code == grpc.StatusCode.DEADLINE_EXCEEDED and \
                        time.monotonic() - t_call >= call_s:
                    continue  # this call's time is up, not the ask's: asked again at once
                self.metrics.failures.labels("coordinator_unreachable").inc()
                self._stop.wait(0.2)  # the coordinator restarts: ask again
