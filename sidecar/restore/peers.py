"""Other hosts' files of a step, over the network tier.

In multi-controller JAX every process is its own host and sees its own RAM disk
only. When a restore needs a region another host saved (onto another mesh, onto
fewer hosts than saved, on a host replaced empty), the bytes come from a
replicator that holds that host's copy of the step: this host's own replicator
when it keeps a peer copy of it (``.mtc-replica/<rank>``), else the saving
host's, else any other listing one, as the replicators' inventories say. Each
file arrives checked against the size and CRC32C its holder lists (the reader
checks it against the manifest again); no host ever opens another host's RAM
disk through a filesystem. With mutual TLS and certificates this process reads
as ranks (``mtc-rank-<r>``, or a JobSet pod's name once the manager was told how
the job names its pods: ``Options.replicator_pod_names``), a replicator's copy
of another rank's data is read only when proven that rank's
(:mod:`..replicator.copies.provenance`), and each file of it is checked against
the SHA-256 its origin signed.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

from mtc.credentials import Credentials, names_read_here
from mtc.errors import ConfigError, CorruptShardError, ProtocolError, ShardUnavailableError
from mtc.grpc_errors import PeerError
from mtc.pool import ThreadPool
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator import checks
from mtc.sidecar.replicator.agree.attest import origin_of
from mtc.sidecar.replicator.copies.provenance import ProofCheck
from mtc.sidecar.replicator.wire.client import PeerClient

log = logging.getLogger(__name__)

INVENTORY_DEADLINE_S = 5.0
# Inventories change only when a step commits, is copied or is deleted: within one
# restore (manifests, then regions) one round serves; a miss asks again at once.
INVENTORY_TTL_S = 10.0

# origin rank -> holders, nearest first: (client, path -> (size, crc32c, SHA-256 its
# origin signed, b"" when its copy carries no proof))
Holders = dict[int, list[tuple[PeerClient, dict[str, tuple[int, int, bytes]]]]]
# the entries listed of a step (what says which rank keeps each saving host's data)
Origins = list[pb.StepCopy]


def order_holders(origin: int, near: int | None, ranks: Sequence[int]) -> list[int]:
    """Positions in ``ranks`` (the replicators' own ranks, -1 for none) to ask for a
    file of ``origin``: this host's replicator first (a peer copy on this host's
    RAM disk crosses no link), then origin's own (it holds the step in its root),
    then the rest in order."""
    here = [i for i, r in enumerate(ranks) if r == near]
    own = [i for i, r in enumerate(ranks) if r == origin and r != near]
    rest = [i for i in range(len(ranks)) if i not in own and i not in here]
    return here + own + rest


class PeerFiles:
    """Reads files of other hosts' steps through the replicators at ``addresses``.

    Owns one client per replicator (closed by :meth:`close`) and the inventories
    of the steps asked about; ``_lock`` guards ``_inventories``. ``near`` is the
    rank of this host's own replicator.
    """

    def __init__(self, addresses: Sequence[str], creds: Credentials | str | None, *,
                 near: int | None, deadline_s: float = 60.0,
                 ranks: Sequence[int] = ()) -> None:
        if not isinstance(creds, Credentials):  # a shared token, or nothing
            creds = Credentials(token=creds)
        self.addresses = list(addresses)
        self.near = near
        self.deadline_s = deadline_s
        # Copies are proven (provenance.py) under mutual TLS where this process reads
        # the ranks certificates name: ``mtc-rank-<r>`` (mtc certs), or a JobSet pod's
        # name once this process was told the job's pod names (the manager does it,
        # from Options.replicator_pod_names, before this is made).
        self._proofs = ProofCheck.of(creds) if names_read_here(creds) else None
        if self._proofs is None and creds.tls:
            log.warning("copies other replicators list are read unproven here: this "
                        "process's certificate %s names no rank it reads (a pod's name: "
                        "give Options(replicator_pod_names=JobSetPlace.pod_names))",
                        creds.tls_cert)
        # ``ranks``: the replicator rank at each address (default: its position). When
        # proofs are checked, its certificate must name that rank: what it lists as
        # its own data is then that rank's.
        ranks = list(ranks) or list(range(len(self.addresses)))
        if len(ranks) != len(self.addresses):
            raise ConfigError(f"{len(ranks)} replicator ranks for {len(self.addresses)} "
                              "replicators")
        self._clients = [PeerClient(a, creds, rank=r, deadline_s=INVENTORY_DEADLINE_S,
                                    as_peer=self._proofs is not None)
                         for a, r in zip(self.addresses, ranks, strict=True)]
        self.unproven = 0  # copies of other ranks' data listed without a valid proof
        self._lock = threading.Lock()
        self._inventories: dict[int, tuple[float, Holders, Origins]] = {}
        # What came over the network tier (for logs and tests): bytes, newest files.
        self.fetched_bytes = 0
        self.fetched: deque[tuple[int, int, str]] = deque(maxlen=256)  # (step, origin, file)

    def close(self) -> None:
        for c in self._clients:
            c.close()

    def _ask(self, client: PeerClient) -> pb.Inventory | None:
        try:
            inv = client.call("GetInventory", pb.InventoryRequest(), attempts=1)
        except PeerError as e:  # a lost host's replicator: its copies are elsewhere
            log.info("replicator %s did not answer its inventory: %s", client.address, e)
            return None
        try:
            checks.bounded(inv, client.rank)  # counted before any proof is checked
        except ProtocolError as e:
            log.warning("replicator %s's inventory is refused: %s", client.address, e)
            return None
        if self._proofs is None:
            return inv  # nobody's rank is proven here: as before
        if inv.rank != client.rank:  # its certificate names client.rank (as_peer)
            log.warning("replicator %s, asked as rank %d, answers as rank %d: not read",
                        client.address, client.rank, inv.rank)
            return None
        gone = self._proofs.drop_unproven(inv)
        if gone:
            with self._lock:
                self.unproven += len(gone)
            log.warning("ignored %d copies replicator %s (rank %d) lists without a valid "
                        "proof that their origin made them: %s", len(gone), client.address,
                        inv.rank, "; ".join(gone[:3])[:2000])
        return inv

    def _holders(self, step: int, *, fresh: bool) -> tuple[Holders, Origins]:
        with self._lock:
            cached = self._inventories.get(step)
        if cached is not None and not fresh and time.monotonic() - cached[0] < INVENTORY_TTL_S:
            return cached[1], cached[2]
        with ThreadPool(len(self._clients), "mtc-inventory", lazy=True) as pool:
            invs = list(pool.map(self._ask, self._clients))
        ranks = [inv.rank if inv is not None else -1 for inv in invs]
        origins: Origins = [c for inv in invs if inv is not None for c in inv.copies
                            if c.step == step]
        holders: Holders = {}
        for origin in sorted({c.origin_rank for inv in invs if inv is not None
                              for c in inv.copies if c.step == step}):
            for i in order_holders(origin, self.near, ranks):
                inv = invs[i]
                copy = next((c for c in inv.copies if c.step == step
                             and c.origin_rank == origin), None) if inv is not None else None
                if copy is not None:
                    files = {f.path: (int(f.size), int(f.crc32c), bytes(f.sha256))
                             for f in copy.files}
                    holders.setdefault(origin, []).append((self._clients[i], files))
        with self._lock:
            self._inventories = {step: (time.monotonic(), holders, origins)}
        return holders, origins

    def _origin(self, entries: Origins, step: int, host: int) -> tuple[int | None, str]:
        """The rank keeping saving host ``host``'s data of ``step``, as ``entries``
        say (its copies' saving ranks; host ``h`` is rank ``h`` unless they say
        otherwise), and ""; None and why not. Where proofs are checked, every
        saving host must say the same (:func:`.attest.origin_of`): one host saying
        "host 0's data is mine" is no reason to read its bytes as host 0's."""
        if self._proofs is not None:
            return origin_of(entries, step, host)
        for c in entries:
            if c.saving_ranks:
                return dict(enumerate(c.saving_ranks)).get(host, host), ""
        return host, ""

    def read(self, step: int, host: int, rel: str) -> bytearray:
        """File ``rel`` of saving host ``host``'s data of ``step`` (kept by the
        replicators as its rank's: host ``h`` is rank ``h`` unless the copies say
        otherwise), verified on arrival. Raises ShardUnavailableError when no
        replicator serves a good copy."""
        errors: list[str] = []
        origin: int | None = host
        for fresh in (False, True):
            holders, origins = self._holders(step, fresh=fresh)
            origin, why = self._origin(origins, step, host)
            if origin is None:
                errors.append(why)
                continue
            for client, files in holders.get(origin, []):
                if rel not in files:
                    continue
                size, crc, sha = files[rel]
                try:
                    data = client.data.fetch_bytes(step, origin, rel, size, crc,
                                              deadline_s=self.deadline_s)
                    if sha and self._proofs is not None and \
                            hashlib.sha256(data).digest() != sha:
                        raise CorruptShardError(f"not the bytes rank {origin} signed",
                                                step=step, host=host, path=rel)
                except (PeerError, CorruptShardError) as e:
                    errors.append(f"{client.address}: {e}")
                    continue
                self.fetched_bytes += size
                self.fetched.append((step, origin, rel))
                return data
        raise ShardUnavailableError(
            f"no replicator serves {rel} of host {host}'s data ("
            f"{f'rank {origin}' if origin is not None else 'no rank'}'s copy; asked "
            f"{', '.join(self.addresses)}{': ' + '; '.join(errors) if errors else ''})",
            step=step, host=host, path=rel)
