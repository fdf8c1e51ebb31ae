"""The controller's side of the peer tier: asking replicators to prepare a restore."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from mtc.errors import AgreementError

if TYPE_CHECKING:
    from sidecar.replicator.security import Credentials

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The agreed step (None: nothing restorable) and the tier each host's data came from."""

    step: int | None
    tiers: dict[str, str]


def prepare_restore(addresses: Sequence[str], *, token: str | None,
                    timeout_s: float, creds: Credentials | None = None) -> Prepared:
    """Ask each replicator (concurrently: they agree with each other) to make
    its host's data of the agreed step local.

    ``creds`` (mutual TLS, token) replaces ``token`` when given."""
    from mtc.proto import replicator_pb2 as pb
    from sidecar.replicator.client import PeerClient
    from sidecar.replicator.security import Credentials

    if creds is None:
        creds = Credentials(token=token)
    clients = [PeerClient(a, creds, rank=i) for i, a in enumerate(addresses)]
    try:
        with ThreadPoolExecutor(len(clients)) as pool:
            replies = list(pool.map(
                lambda c: c.call("PrepareRestore",
                                 pb.PrepareRestoreRequest(timeout_seconds=timeout_s),
                                 deadline_s=timeout_s + 30, attempts=1), clients))
    finally:
        for c in clients:
            c.close()
    steps = {r.step for r in replies}
    for a, r in zip(addresses, replies, strict=True):
        log.info("replicator %s: step %d from the %s tier in %.2fs", a, r.step, r.tier, r.seconds)
    if len(steps) != 1:
        raise AgreementError(f"replicators disagree on the step to restore: {sorted(steps)}")
    step = steps.pop()
    return Prepared(None if step < 0 else step,
                    {a: r.tier for a, r in zip(addresses, replies, strict=True)})
