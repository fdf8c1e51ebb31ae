"""Answering Orbax's client (:mod:`.orbax`'s file protocol): each ``replicator.yaml``
main takes is answered on a thread of this service (:class:`mtc.lifecycle.Service`),
one at a time, so that an agreement (up to its deadline) never holds main's loop,
which keeps watching health meanwhile."""

from __future__ import annotations

import logging
import queue
from pathlib import Path
from typing import Protocol

from mtc.errors import MtcError
from mtc.lifecycle import Threads
from mtc.sidecar.replicator import orbax
from mtc.sidecar.replicator.fetch.restore import RestoreAsk

log = logging.getLogger("mtc.replicator")


class RestoresForClient(Protocol):
    """The restore an Orbax client start asks for
    (:meth:`~mtc.sidecar.replicator.fetch.restore.Restorer.restore_for_client`)."""

    def restore_for_client(self, job: str, ask: RestoreAsk | None = None) -> int: ...


class OrbaxClient:
    """Client starts of rank ``rank`` of ``num_nodes``, in the RAM disk ``root``."""

    def __init__(self, root: Path, rank: int, num_nodes: int,
                 restores: RestoresForClient) -> None:
        self.root = root
        self.rank = rank
        self.num_nodes = num_nodes
        self._restores = restores
        self._q: queue.Queue[orbax.ClientRequest | None] = queue.Queue()

    def put(self, request: orbax.ClientRequest) -> None:
        """Answer ``request`` after those before it."""
        self._q.put(request)

    def start(self, threads: Threads) -> None:
        threads.start(self._run, "mtc-orbax-client")

    def stop(self) -> None:
        self._q.put(None)  # after the request being answered (it ends with the node)

    def close(self) -> None:
        pass

    def _run(self) -> None:
        while (request := self._q.get()) is not None:
            self.answer(request)

    def answer(self, request: orbax.ClientRequest) -> None:
        """Serve one Orbax client start: agree on a step and write the restore marker."""
        root = self.root
        try:
            if request.rank != self.rank or request.nodes != self.num_nodes:
                orbax.report(root, f"{orbax.YAML_NAME} names rank {request.rank} of "
                                   f"{request.nodes}; this replicator is rank {self.rank} of "
                                   f"{self.num_nodes}", fatal=True)
                return
            try:
                # Re-served (after a restart), it reads its decision again.
                step = self._restores.restore_for_client(request.job_name,
                                                         RestoreAsk(request.restore_id))
                log.info("rank %d: told the client to restore step %d", self.rank, step)
            except (MtcError, OSError) as e:
                log.exception("restore for the client failed")
                orbax.report(root, f"restore failed: {e}", fatal=True)
        finally:
            orbax.done_request(root)
