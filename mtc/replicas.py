"""The controller's side of the peer tier: asking replicators to prepare a restore."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from mtc.errors import AgreementError

if TYPE_CHECKING:
    from mtc_sidecar.replicator.client import PeerClient
    from mtc_sidecar.replicator.security import Credentials

log = logging.getLogger(__name__)
RETRY_S = 0.2  # between tries to a replicator that is restarting
MATERIALIZE_S = 30.0  # beyond the agreement deadline, for a host's data to arrive


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


def prepare_restore(addresses: Sequence[str], *, token: str | None,
                    timeout_s: float, creds: Credentials | None = None,
                    restore_id: str | None = None,
                    members: Sequence[int] = (), background: bool = False) -> Prepared:
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
    it again with the returned ``restore_id`` to wait for the data."""
    from mtc_sidecar.replicator.client import PeerClient
    from mtc_sidecar.replicator.security import Credentials

    if creds is None:
        creds = Credentials(token=token)
    rid = restore_id or uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    cancelled = threading.Event()
    clients = [PeerClient(a, creds, rank=i) for i, a in enumerate(addresses)]
    pool = ThreadPoolExecutor(len(clients), thread_name_prefix="mtc-prepare")
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
        for c in clients:
            c.close()  # cancels calls still in flight
        pool.shutdown(wait=False, cancel_futures=True)
    for a, r in zip(addresses, replies, strict=True):
        log.info("replicator %s: step %d (epoch %d) from the %s tier in %.2fs%s",
                 a, r.step, r.epoch, r.tier, r.seconds,
                 " (its data still on the way)" if r.pending else "")
    decided = {(r.epoch, r.step) for r in replies}
    if len(decided) != 1:
        raise AgreementError(f"replicators read different decisions (epoch, step): "
                             f"{sorted(decided)}")
    epoch, step = decided.pop()
    return Prepared(None if step < 0 else step,
                    {a: r.tier for a, r in zip(addresses, replies, strict=True)}, epoch,
                    frozenset(a for a, r in zip(addresses, replies, strict=True) if r.pending),
                    rid)


def _prepare_one(client: PeerClient, rid: str, deadline: float,
                 cancelled: threading.Event, members: tuple[int, ...],
                 background: bool) -> Any:
    """PrepareRestore on one replicator, sent again while it is unreachable
    (restarting) and time is left; any other error is raised as its domain type."""
    from mtc.proto import replicator_pb2 as pb
    from mtc_sidecar.replicator.client import PeerError
    from mtc_sidecar.replicator.status import is_retryable

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
            if not is_retryable(e):
                raise e.kind(f"replicator {client.address}: {e}", host=client.rank) from e
            if time.monotonic() + RETRY_S >= deadline:
                raise AgreementError(f"replicator {client.address} did not answer the "
                                     f"restore in time: {e}", host=client.rank) from e
            log.info("replicator %s unavailable (%s); asking again", client.address, e.code)
            cancelled.wait(RETRY_S)
