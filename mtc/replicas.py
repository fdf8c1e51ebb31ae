"""The controller's side of the peer tier: asking replicators to prepare a restore
(:func:`prepare_restore`), as a job's hosts see them (:class:`ReplicatorTier`), and
what they report (:func:`inventory`) or are asked for (:func:`request_backup`) by
``mtc status``, ``mtc backup`` and mtc.testing."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtc.errors import AgreementError, ConfigError, MtcError
from mtc.pool import ThreadPool

if TYPE_CHECKING:
    from mtc.credentials import Credentials
    from mtc.options import Options
    from mtc.proto import replicator_pb2 as pb
    from mtc.sidecar.replicator.wire.client import PeerClient
    from mtc.topology import Topology

log = logging.getLogger(__name__)
RETRY_S = 0.2  # between tries to a replicator that is restarting
MATERIALIZE_S = 30.0  # beyond the agreement deadline, for a host's data to arrive
RESTORED_S = 2.0  # for a replicator to take the hint that the job's load is over
# Where a host's data came from, nearest first; a restore reports the farthest.
TIERS = ("local", "peer", "backup")


def farthest(tiers: dict[int, str]) -> str:
    """The farthest tier any host's data came from ("local" when none)."""
    return max(tiers.values(), key=lambda t: TIERS.index(t) if t in TIERS else -1,
               default="local")


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The agreed step (None: nothing restorable), the tier each host's data came
    from, and the replicators whose host's data is still on its way (asked with
    ``background``); ``restore_id`` asks them again for the same decision."""

    step: int | None
    tiers: dict[str, str]
    epoch: int = 0
    pending: frozenset[str] = frozenset()
    restore_id: str = ""
    run: str = ""  # the run whose bytes make the step ("": not named, or the backup's)
    lost: str = ""  # step None while hosts hold data: whose data of which steps is gone


def prepare_restore(addresses: Sequence[str], *, token: str | None,
                    timeout_s: float, creds: Credentials | None = None,
                    restore_id: str | None = None,
                    members: Sequence[int] = (), background: bool = False,
                    ranks: Sequence[int] | None = None) -> Prepared:
    """Ask each replicator (concurrently: they read one decision) to make its
    host's data of the agreed step local.

    ``members``: the replicator ranks of every host of the job restoring, stated
    by the job (in multi-controller JAX each process asks only its own replicators
    but states the whole job's): they, and only they, must ask and answer before
    a step is decided. Empty: every node the replicators were started with.

    Every request carries one restore id, so a replicator that restarts during
    the restore is asked again (within ``timeout_s``) and reads the same decision.
    The first typed error is raised as soon as it arrives; the slower calls are
    cancelled. ``creds`` (mutual TLS, token) replaces ``token`` when given.

    ``background``: a replicator whose host holds no copy of the step answers
    once it is agreed and brings the data in the background (``pending``); ask
    it again with the returned ``restore_id`` to wait for the data. ``ranks``: each
    address's replicator rank (default: its position), which errors name."""
    from mtc.credentials import Credentials

    if creds is None:
        creds = Credentials(token=token)
    rid = restore_id or uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    cancelled = threading.Event()
    with _each(addresses, creds, ranks, "mtc-prepare") as (clients, pool):
        try:
            futs = [pool.submit(_prepare_one, c, rid, deadline, cancelled, tuple(members),
                                background) for c in clients]
            done, _ = wait(futs, return_when=FIRST_EXCEPTION)
            for f in futs:
                if f in done and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            replies = [f.result() for f in futs]
        finally:
            cancelled.set()
    for a, r in zip(addresses, replies, strict=True):
        log.info("replicator %s: step %d (epoch %d) from the %s tier in %.2fs%s",
                 a, r.step, r.epoch, r.tier, r.seconds,
                 " (its data still on the way)" if r.pending else "")
    decided = {(r.epoch, r.step, r.run) for r in replies}
    if len(decided) != 1:
        raise AgreementError(f"replicators read different decisions (epoch, step, run): "
                             f"{sorted(decided)}")
    epoch, step, run = decided.pop()
    return Prepared(None if step < 0 else step,
                    {a: r.tier for a, r in zip(addresses, replies, strict=True)}, epoch,
                    frozenset(a for a, r in zip(addresses, replies, strict=True) if r.pending),
                    rid, run, replies[0].lost)


def tell_restored(addresses: Sequence[str], prepared: Prepared, *, creds: Credentials,
                  ranks: Sequence[int] | None = None, deadline_s: float = RESTORED_S) -> int:
    """Tell each replicator (concurrently) that the job has loaded ``prepared``'s
    step: a replaced host's background fetch starts now instead of when the
    quiet time after the restore runs out. A hint: a replicator that does not
    answer within ``deadline_s`` is logged and left to its quiet time. ``ranks``:
    each address's replicator rank (default: its position). Returns how many
    background fetches started."""
    from mtc.proto import replicator_pb2 as pb

    if prepared.step is None or not prepared.restore_id or not addresses:
        return 0
    request = pb.RestoredRequest(restore_id=prepared.restore_id, step=prepared.step)

    def tell(c: PeerClient) -> bool:
        try:
            return bool(c.call("Restored", request, deadline_s=deadline_s,
                               attempts=1).fetching)
        except MtcError as e:  # a hint: the restore has succeeded whatever it meets
            log.warning("replicator %s was not told the restore of step %d ended (%s); "
                        "its quiet time ends on its own", c.address, prepared.step, e)
            return False

    with _each(addresses, creds, ranks, "mtc-restored") as (clients, pool):
        return sum(pool.map(tell, clients))


@contextlib.contextmanager
def _each(addresses: Sequence[str], creds: Credentials, ranks: Sequence[int] | None,
          name: str) -> Iterator[tuple[list[PeerClient], ThreadPool]]:
    """A client per replicator (``ranks``: each address's rank, default its
    position) and a thread per client to ask them all at once. On the way out the
    clients close first (cancelling calls still in flight), then the pool ends
    without waiting for calls already cancelled."""
    from mtc.sidecar.replicator.wire.client import PeerClient

    clients = [PeerClient(a, creds, rank=ranks[i] if ranks is not None else i)
               for i, a in enumerate(addresses)]
    pool = ThreadPool(len(clients), name, lazy=True)
    try:
        yield clients, pool
    finally:
        for c in clients:
            c.close()
        pool.shutdown(wait=False, cancel_futures=True)


def _prepare_one(client: PeerClient, rid: str, deadline: float,
                 cancelled: threading.Event, members: tuple[int, ...],
                 background: bool) -> Any:
    """PrepareRestore on one replicator, sent again while it is unreachable
    (restarting) and time is left; any other error is raised as its domain type."""
    from mtc.grpc_errors import PeerError, is_retryable
    from mtc.proto import replicator_pb2 as pb

    while True:
        left = deadline - time.monotonic()
        try:
            return client.call("PrepareRestore",
                               pb.PrepareRestoreRequest(timeout_seconds=max(0.5, left),
                                                        restore_id=rid, members=members,
                                                        background=background),
                               deadline_s=max(0.5, left) + MATERIALIZE_S, attempts=1)
        except PeerError as e:
            if cancelled.is_set():
                raise
            if not is_retryable(e):  # the replicator's own error, named once
                raise e.kind(e.message, step=e.step, host=e.host, path=e.path) from e
            if time.monotonic() + RETRY_S >= deadline:
                # Named by rank, as the replicators' own agreement errors name it.
                raise AgreementError(f"replicator rank {client.rank} ({client.address}) did "
                                     f"not answer the restore in time: {e.message}",
                                     host=client.rank) from e
            log.info("replicator %s unavailable (%s); asking again", client.address, e.code)
            cancelled.wait(RETRY_S)


def inventory(address: str, *, token: str = "", creds: Credentials | None = None,
              rank: int = -1, identify: bool = False, deadline_s: float = 5.0
              ) -> pb.Inventory:
    """What the replicator at ``address`` holds (``identify``: and its identity,
    configuration and replication state), asked once. One that cannot be reached,
    or refuses, raises a :class:`~mtc.errors.RetryableError` (the client's
    ``PeerError``). ``creds`` (mutual TLS, token) replaces ``token`` when given;
    ``rank``: the replicator's, which errors name (-1: unknown)."""
    from mtc.proto import replicator_pb2 as pb

    with _client(address, token, creds, rank, deadline_s) as client:
        inv: pb.Inventory = client.call("GetInventory", pb.InventoryRequest(identify=identify),
                                        attempts=1)
    return inv


def request_backup(address: str, *, token: str = "", creds: Credentials | None = None,
                   timeout_s: float = 3600.0) -> int:
    """Have the replicator at ``address`` back up the job's newest complete step now
    (``mtc backup``); returns the step (-1: none to back up)."""
    from mtc.proto import replicator_pb2 as pb

    with _client(address, token, creds, -1, timeout_s) as client:
        reply = client.call("RequestBackup", pb.BackupRequest(step=-1), deadline_s=timeout_s,
                            attempts=1)
    return int(reply.step)


@contextlib.contextmanager
def _client(address: str, token: str, creds: Credentials | None, rank: int,
            deadline_s: float) -> Iterator[PeerClient]:
    """A client of one replicator, closed on the way out."""
    from mtc.credentials import Credentials
    from mtc.sidecar.replicator.wire.client import PeerClient

    client = PeerClient(address, creds or Credentials(token=token), rank=rank,
                        deadline_s=deadline_s)
    try:
        yield client
    finally:
        client.close()


class ReplicatorTier:
    """A job's replicators, as its controller asks them: one per host
    (``Options.replicators``, by host), each answering for its host's data."""

    def __init__(self, options: Options, topology: Topology) -> None:
        addrs = tuple(options.replicators or ())
        if len(addrs) != topology.num_hosts:
            raise ConfigError(f"{len(addrs)} replicator addresses for "
                              f"{topology.num_hosts} hosts")
        ranks = options.replicator_ranks or tuple(range(topology.num_hosts))
        if len(ranks) != topology.num_hosts:
            raise ConfigError(f"{len(ranks)} replicator ranks for {topology.num_hosts} hosts")
        self.options = options
        self.addresses = addrs
        # The job's membership, stated: every host of this job (not only this
        # process's), by its replicator's rank. A job that came back on fewer hosts
        # than saved agrees among its own; the others' data must come from peers.
        self.ranks = tuple(ranks)
        self.local_hosts = tuple(topology.local_hosts)

    def prepare(self, timeout_s: float | None = None, *, background: bool = False
                ) -> Prepared:
        """Have each local host's replicator agree on a step and make its data local
        (verified; bad files healed from other holders). A file with no good copy
        anywhere comes back as CorruptShardError naming it. ``background``: a host
        holding no copy answers once agreed (pending)."""
        return prepare_restore([self.addresses[h] for h in self.local_hosts],
                               token=self.options.replicator_token,
                               creds=credentials(self.options), members=self.ranks,
                               background=background,
                               timeout_s=timeout_s or self.options.restore_timeout_s,
                               ranks=[self.ranks[h] for h in self.local_hosts])

    def wait_local(self, prepared: Prepared) -> None:
        """Ask the pending hosts' replicators again, with the same restore id (the
        same decision), to answer once their data is local."""
        pending = sorted(prepared.pending)
        rank_of = {a: r for a, r in zip(self.addresses, self.ranks, strict=True)}
        again = prepare_restore(pending, token=self.options.replicator_token,
                                creds=credentials(self.options), members=self.ranks,
                                restore_id=prepared.restore_id,
                                timeout_s=self.options.restore_timeout_s,
                                ranks=[rank_of[a] for a in pending])
        if again.step != prepared.step:
            raise AgreementError(f"asked again, the replicators say step {again.step}",
                                 step=prepared.step)

    def restored(self, prepared: Prepared) -> None:
        """The job has loaded ``prepared``'s step: each local host's replicator is
        told (a replaced host's data starts coming now)."""
        fetching = tell_restored([self.addresses[h] for h in self.local_hosts], prepared,
                                 creds=credentials(self.options),
                                 ranks=[self.ranks[h] for h in self.local_hosts])
        if fetching:
            log.info("mtc: %d host(s) fetch their data of step %d now", fetching,
                     prepared.step)

    def host_tiers(self, prepared: Prepared) -> dict[int, str]:
        """Per local host, the tier its data of ``prepared`` comes from."""
        return {h: prepared.tiers.get(self.addresses[h], "local") for h in self.local_hosts}

    def pending_hosts(self, prepared: Prepared | None) -> frozenset[int]:
        """The local hosts whose data of ``prepared`` is still on its way."""
        if prepared is None or not prepared.pending:
            return frozenset()
        return frozenset(h for h in self.local_hosts if self.addresses[h] in prepared.pending)


def credentials(options: Options) -> Credentials:
    """The replicators' shared token and, with ``replicator_tls``, this process's
    certificate (mutual TLS)."""
    from mtc.credentials import Credentials

    tls = options.replicator_tls
    cert, key, ca = (Path(p) for p in tls) if tls else (None, None, None)
    return Credentials(options.replicator_token, cert, key, ca)
