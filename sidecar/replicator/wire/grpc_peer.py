"""The transport seam (``transport.py``) over gRPC and the data channel: each of a
peer's calls in the replicator's vocabulary is one gRPC call of
:class:`~.client.PeerClient` (its deadlines, retries, channels, credentials), and
each of its byte paths :class:`~.peer_data.PeerData`'s (the data channel, else
gRPC's Data service). Nothing here decides anything about copies: it moves them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mtc.errors import MtcError
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.replicator.transport import Opener, Pushed
from mtc.sidecar.replicator.wire.client import PeerClient


class GrpcPeer:
    """Peer ``client.rank`` through ``client`` (closed by its owner)."""

    def __init__(self, client: PeerClient) -> None:
        self.client = client
        self.rank = client.rank
        self.address = client.address

    def inventory(self, req: pb.InventoryRequest, *, deadline_s: float | None = None,
                  attempts: int = 3, known_up: bool = False) -> pb.Inventory:
        reply: pb.Inventory = self.client.call("GetInventory", req, deadline_s=deadline_s,
                                               attempts=attempts, known_up=known_up)
        return reply

    def decide(self, req: pb.DecideRequest, *, deadline_s: float) -> pb.DecideReply:
        reply: pb.DecideReply = self.client.call("Decide", req, deadline_s=deadline_s,
                                                 attempts=1)
        return reply

    def complete(self, *, deadline_s: float) -> pb.CompleteReply:
        reply: pb.CompleteReply = self.client.call("GetComplete", pb.CompleteRequest(),
                                                   deadline_s=deadline_s, attempts=1)
        return reply

    def offer(self, req: pb.OfferRequest) -> pb.OfferReply:
        reply: pb.OfferReply = self.client.call("Offer", req)
        if reply.data_port:
            self.client.data_port = reply.data_port  # its data channel, for the push
        return reply

    def link(self, transfer_id: str, paths: list[str]) -> pb.LinkReply:
        reply: pb.LinkReply = self.client.call(
            "Link", pb.LinkRequest(transfer_id=transfer_id, paths=paths))
        return reply

    def push(self, transfer_id: str, files: Pushed) -> int | None:
        return self.client.data.push_data(transfer_id, [(i, p, n, c) for i, _, p, n, c in files])

    def push_batch(self, transfer_id: str, files: Pushed) -> None:
        if len(files) == 1:
            _, rel, path, size, crc = files[0]
            self.client.data.push_file(transfer_id, rel, path, size, crc)
        else:
            self.client.data.push_files(transfer_id, [(i, p, n, c) for i, _, p, n, c in files])

    def commit(self, transfer_id: str) -> pb.CommitReply:
        reply: pb.CommitReply = self.client.call(
            "Commit", pb.CommitRequest(transfer_id=transfer_id))
        return reply

    def abort(self, transfer_id: str) -> None:
        self.client.call("Abort", pb.AbortRequest(transfer_id=transfer_id), attempts=1)

    def fetch(self, step: int, origin: int, rel: str, dest: Path, size: int,
              crc: int) -> None:
        self.client.data.fetch_file(step, origin, rel, dest, size, crc)

    def fetch_many(self, step: int, origin: int, files: list[FileMeta], dest: Path, *,
                   opener: Opener | None = None) -> tuple[list[str], MtcError | None]:
        return self.client.data.fetch_files(step, origin, files, dest, opener=opener)

    def backup_part(self, req: pb.BackupPartRequest) -> pb.BackupPartReply:
        reply: pb.BackupPartReply = self.client.call("BackupPart", req, deadline_s=3600,
                                                     attempts=1)
        return reply

    def request_backup(self) -> pb.BackupReply:
        reply: pb.BackupReply = self.client.call("RequestBackup", pb.BackupRequest(step=-1),
                                                 deadline_s=3600, attempts=1)
        return reply



if TYPE_CHECKING:
    from mtc.sidecar.replicator.transport import Peer

    def _is_a_peer(p: GrpcPeer) -> Peer:  # mypy checks it implements the seam
        return p
