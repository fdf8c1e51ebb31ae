"""How a replicator reaches another, in its own vocabulary: the transport seam.

The replicator's logic (``store/``, ``copies/``, ``agree/``, ``fetch/``) calls a
peer only through :class:`Peer`: its inventory, the restore agreement's decision
(``decide``) and garbage collection's view (``complete``), the copy protocol
(``offer``, ``link``, ``push``, ``commit``, ``abort``), a fetch's bytes
(``fetch``), and the backup tier's calls (``backup_part``, ``request_backup``:
``sidecar/backup/duties.py``). Two implementations:

- ``wire/grpc_peer.py`` (:class:`~mtc.sidecar.replicator.wire.grpc_peer.GrpcPeer`):
  gRPC for the calls and the data channel (or gRPC's Data service) for the bytes;
  what ``wire/`` adds is only the moving of bytes (connections, retries, streams,
  authentication);
- ``memory_transport.py``: calls straight into another replicator's parts in the
  same process, with faults (a dropped call, a delay, a partition) for tests.

Failures come back as :class:`~mtc.grpc_errors.PeerError`, whose ``code`` is the
status the receiving side's error maps to (``mtc/grpc_errors.py``: one map for
every transport); ``unreachable`` when the peer was not reached at all.
Messages are the protocol's (``mtc.proto``); a peer's answers are untrusted and
checked by the caller (``checks.py``) whatever carried them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mtc.errors import MtcError
    from mtc.proto import replicator_pb2 as pb
    from mtc.sidecar.replicator.store.step_files import FileMeta

# ``opener(dest, path, size)``: a fetched file's descriptor, open for writing at its
# start (a blank file set aside for it, ``Reserve.open_new``).
Opener = Callable[[Path, str, int], int]
# Files of a push: (index in the offer's file list, its path there, the local
# file, size, CRC32C).
Pushed = list[tuple[int, str, Path, int, int]]


class Peer(Protocol):
    """Another replicator, rank :attr:`rank`, as this one's logic calls it."""

    rank: int
    address: str  # where it is reached, for errors that name it

    def inventory(self, req: pb.InventoryRequest, *, deadline_s: float | None = None,
                  attempts: int = 3, known_up: bool = False) -> pb.Inventory:
        """What it holds (or only its identity, or rank: ``req`` says). ``known_up``:
        the caller knows it serves (it has just called us): not held back by a
        connection still backing off from its loss."""
        ...

    def decide(self, req: pb.DecideRequest, *, deadline_s: float) -> pb.DecideReply:
        """One ask of the restore agreement's decider (once: the caller asks again)."""
        ...

    def complete(self, *, deadline_s: float) -> pb.CompleteReply:
        """The steps its coordinator keeps from garbage collection (once)."""
        ...

    def offer(self, req: pb.OfferRequest) -> pb.OfferReply:
        """Offer a copy; the reply names the files to link and the transfer to push into."""
        ...

    def link(self, transfer_id: str, paths: list[str]) -> pb.LinkReply:
        """Have it take ``paths`` of the transfer from identical bytes it holds."""
        ...

    def push(self, transfer_id: str, files: Pushed) -> int | None:
        """Files of the transfer as one stream (its data path); the bytes sent, or
        None when that path cannot be had now (the caller pushes in batches)."""
        ...

    def push_batch(self, transfer_id: str, files: Pushed) -> None:
        """Files of the transfer in one call (a few small ones, or one)."""
        ...

    def commit(self, transfer_id: str) -> pb.CommitReply:
        ...

    def abort(self, transfer_id: str) -> None:
        """Drop the transfer (once: an abort lost is expired by the receiver)."""
        ...

    def fetch(self, step: int, origin: int, rel: str, dest: Path, size: int,
              crc: int) -> None:
        """One file of ``origin``'s copy of ``step`` it holds into ``dest``, verified."""
        ...

    def fetch_many(self, step: int, origin: int, files: list[FileMeta], dest: Path, *,
                   opener: Opener | None = None) -> tuple[list[str], MtcError | None]:
        """Several files in one stream into ``dest``: the paths that arrived
        verified, in order, and the error that ended it early (None: all did)."""
        ...

    def backup_part(self, req: pb.BackupPartRequest) -> pb.BackupPartReply:
        """Have it upload its part of a step's backup (once; up to an hour)."""
        ...

    def request_backup(self) -> pb.BackupReply:
        """Ask it (the backup leader) to back up now (once; up to an hour)."""
        ...


Peers = Mapping[int, Peer]
