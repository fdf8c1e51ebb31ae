"""Whole replicators in one process, over the in-memory transport: the cluster
harness of the replicator's logic tests (raft's ``testing.go``: ``MakeCluster``,
``Partition``, ``WaitEvent`` on its in-memory transport).

Each simulated host is a :class:`~.node.Node` with every service running (the
replication loop, garbage collection, the agreement, restores, backups: the
threads ``mtc-replicator`` runs), a RAM disk of its own (``<base>/host-<rank>``, a
folder no other node is handed) and peers reached only through
:class:`~.memory_transport.Network`: the same code as a replicator process, less
its gRPC server, sockets and process. A test plays the hosts (commits steps,
flips bytes, wipes a root) and the network (partition, drop, delay, heal), and
waits on what the nodes count (copies held, loop passes, metrics), never on time::

    with MemoryCluster(tmp_path, 4, per_slice=2) as c:
        c.commit(0, 5, {"a.bin": b"..."})
        c.wait_held({(2, 0, 5)})
        c.net.partition({0, 1}, {2, 3})
        c.kill(2)          # gone at once: unreachable, its threads ended
        c.wipe(2)          # its RAM disk lost too
        c.start(2)         # a replaced host on the same rank
        replies = c.prepare([0, 1, 2, 3])

What needs a real process stays with ``tests/replicators.py``'s processes: a
SIGKILL mid-write, network namespaces, the data channel's sockets, TLS and
authentication on listeners, the wire format. ``kill`` here ends a node's threads
and takes it off the network: a call in flight into it may still finish on its
caller's thread (as a request already on a server's queue would), nothing of the
node runs after that.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from mtc.credentials import Credentials
from mtc.errors import MtcError
from mtc.integrity import crc32c
from mtc.lifecycle import Services
from mtc.manifest import MANIFEST_NAME, LeafEntry, Manifest, ShardEntry
from mtc.pool import ThreadPool
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator import checks
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.memory_transport import Endpoint, MemoryPeer, Network
from mtc.sidecar.replicator.node import Node
from mtc.sidecar.storage.publish import publish
from mtc.testing.replicas import Replicators

T = TypeVar("T")

# What a test cluster runs with unless it says otherwise: short deadlines and polls
# (a test waits on them), restores not held quiet, no blank space set aside and no
# background scrub (tests that damage a file check which reader finds it; a scrub
# finding it first would race them), GC's view of the complete steps gathered up
# to 50 times a second (a GC pass that asks for it waits for the next gather: at 5
# a second, most of a cluster test's passes were that wait). A test that is about
# one of these sets it.
DEFAULTS: dict[str, Any] = {"poll_s": 0.05, "deadline_s": 2.0, "agreement_timeout_s": 10.0,
                            "restore_quiet_s": 0.0, "reserve": False, "scrub_rate": 0.0,
                            "gc_view_interval_s": 0.02}

class MemoryCluster(Replicators):
    """``n`` replicators, ``per_slice`` hosts a slice, over :attr:`net`; started now
    unless ``start=False``; ``run=False``: nodes served but none of their threads
    started (no loop, no background work: a test drives the logic by hand, as
    ``replication.push_step``). ``config``: fields of every node's
    :class:`~.config.ReplicatorConfig` (over :data:`DEFAULTS`); ``rank_config``: one
    rank's own (another ``keep``); ``creds``: every node's, ``rank_creds``: one
    rank's own (with mutual TLS, its certificate naming its rank: what it signs its
    copies' proofs with, and the CA it checks others' with; calls in memory are not
    authenticated, ``wire/security.py``'s part, tested over gRPC); ``roots``: some
    ranks' RAM disks elsewhere than under ``base``."""

    def __init__(self, base: Path, n: int, per_slice: int = 1, *, start: bool = True,
                 run: bool = True,
                 rank_config: dict[int, dict[str, Any]] | None = None,
                 creds: Credentials | None = None,
                 rank_creds: dict[int, Credentials] | None = None,
                 roots: dict[int, Path] | None = None, **config: Any) -> None:
        self.base = base
        self.roots = dict(roots or {})  # a rank's RAM disk elsewhere than <base>/host-<rank>
        self.n = n
        self.per_slice = per_slice
        self.config = config
        self.rank_config = dict(rank_config or {})
        self.creds = creds or Credentials()
        self.rank_creds = dict(rank_creds or {})
        self.run = run
        self.net = Network()
        self.nodes: dict[int, Node] = {}
        self._services: dict[int, Services | None] = {}
        if start:
            self.start_all()

    # -- hosts --------------------------------------------------------------------------

    def root(self, rank: int) -> Path:
        """Host ``rank``'s RAM disk: its node's alone."""
        return self.roots.get(rank, self.base / f"host-{rank}")

    def config_of(self, rank: int, **more: Any) -> ReplicatorConfig:
        fields = {"nodes": tuple(f"memory:{r}" for r in range(self.n)),
                  "nodes_per_slice": self.per_slice,
                  **DEFAULTS, **self.config, **self.rank_config.get(rank, {}), **more}
        return ReplicatorConfig(rank=rank, **fields)

    def start(self, rank: int, *, route: dict[int, int] | None = None, **config: Any) -> Node:
        """Start host ``rank``'s replicator on its root as it is (a restart when one ran
        before: :meth:`kill` it first); ``config``: this start's own fields.
        ``route``: where its peers' places really lead (``{0: 1, 1: 0}``: its
        ``nodes`` list ranks 0 and 1 swapped), as a wrong ``--nodes`` does."""
        if rank in self.nodes:
            raise RuntimeError(f"rank {rank}'s replicator is running: kill it first")
        root = self.root(rank)
        root.mkdir(parents=True, exist_ok=True)
        peers = self.net.peers(rank, self.n)
        for place, dst in (route or {}).items():
            peers[place] = MemoryPeer(self.net, rank, dst)
        node = Node(self.config_of(rank, **config), root,
                    self.rank_creds.get(rank, self.creds), peers=peers)
        services = None
        if self.run:
            services = Services(f"memory-replicator-{rank}", [node])
            services.start()
        self.nodes[rank] = node
        self._services[rank] = services
        self.net.serve(rank, Endpoint.of(node))
        return node

    def start_all(self) -> None:
        for r in range(self.n):
            if r not in self.nodes:
                self.start(r)

    def alive(self, rank: int) -> bool:
        return rank in self.nodes

    def kill(self, rank: int) -> None:
        """Host ``rank``'s replicator gone: off the network first (every call to it
        fails from now), then its threads ended; its root stays as it was."""
        node = self.nodes.pop(rank, None)
        if node is None:
            return
        self.net.stop_serving(rank)
        services = self._services.pop(rank)
        if services is not None:
            services.shutdown(30.0, reraise=False)
        else:
            node.stop()
            node.close()

    def wipe(self, rank: int) -> None:
        """Host ``rank``'s RAM disk lost (its replicator must be down)."""
        if rank in self.nodes:
            raise RuntimeError(f"rank {rank}'s replicator is running: kill it first")
        shutil.rmtree(self.root(rank), ignore_errors=True)

    def lose_host(self, rank: int) -> None:
        """Host ``rank`` is gone: its replicator killed, its RAM disk wiped."""
        self.kill(rank)
        self.wipe(rank)

    def replace_host(self, rank: int, **config: Any) -> Node:
        """Host ``rank`` lost and a new one in its place: an empty RAM disk, a new node."""
        self.lose_host(rank)
        return self.start(rank, **config)

    def close(self) -> None:
        for r in list(self.nodes):
            self.kill(r)

    def __enter__(self) -> MemoryCluster:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None
                 ) -> None:
        self.close()

    # -- the host's side: steps as a client commits them ----------------------------------

    def commit(self, rank: int, step: int, files: dict[str, bytes], *,
               orbax: bool = False) -> dict[str, bytes]:
        """Commit ``files`` as host ``rank``'s step, with an mtc manifest naming it
        (``orbax``: opaque, as Orbax's client's); every file committed."""
        if orbax:
            commit_raw_step(self.root(rank), step, files)
            return dict(files)
        return commit_mtc_step(self.root(rank), step, files, host=rank, num_hosts=self.n,
                               slice_of_host=rank // self.per_slice)

    def own_steps(self, rank: int) -> set[int]:
        """Host ``rank``'s committed steps, as the host sees its root."""
        return {int(n) for n in os.listdir(self.root(rank)) if n.isdigit()}

    # -- what the nodes report (the waits on it: Replicators') ----------------------------

    def inventory(self, rank: int) -> pb.Inventory:
        """What rank ``rank`` shows a peer (its GetInventory), asked in memory."""
        return self.nodes[rank].shown.inventory()

    def scrape(self, rank: int) -> dict[str, float]:
        """Rank's metrics as a scrape reads them: ``name`` or ``name{label=v,...}``."""
        out = {}
        for fam in self.nodes[rank].metrics.registry.collect():
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    # -- what a job asks ----------------------------------------------------------------------

    def prepare(self, ranks: Sequence[int], timeout: float = 30.0, *,
                members: Sequence[int] = (), rid: str = "restore-1"
                ) -> dict[int, pb.PrepareRestoreReply | MtcError]:
        """PrepareRestore on every one of ``ranks`` at once, as a restarting job asks
        it (the servicer's own steps: the request's checks, then the restorer): each
        rank's reply, or the typed error it answered (the servicer maps it to a
        status: ``mtc.grpc_errors.to_status``)."""
        def one(r: int) -> pb.PrepareRestoreReply | MtcError:
            try:
                d, tier, seconds, pending = self.nodes[r].restorer.prepare_restore_as(
                    timeout, checks.restore_id(rid), list(members))
            except MtcError as e:  # what its caller gets, for the test to compare
                return e
            return pb.PrepareRestoreReply(step=d.step, tier=tier, seconds=seconds,
                                          epoch=d.epoch, pending=pending, run=d.run,
                                          lost=d.lost)
        return dict(zip(ranks, at_once(*[lambda r=r: one(r) for r in ranks]), strict=True))

    def prepared(self, ranks: Sequence[int], timeout: float = 30.0, *,
                 members: Sequence[int] = (), rid: str = "restore-1"
                 ) -> dict[int, pb.PrepareRestoreReply]:
        """:meth:`prepare`, every rank's reply (the first error raised)."""
        out = self.prepare(ranks, timeout, members=members, rid=rid)
        for got in out.values():
            if isinstance(got, Exception):
                raise got
        return {r: got for r, got in out.items() if isinstance(got, pb.PrepareRestoreReply)}


def at_once(*calls: Callable[[], T]) -> list[T]:
    """Each call on a thread of its own, all started together; their results, in order."""
    pool = ThreadPool(max(1, len(calls)), "memory-cluster-at-once")
    try:
        return [f.result() for f in [pool.submit(fn) for fn in calls]]
    finally:
        pool.shutdown()


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``, by its path there."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def commit_mtc_step(root: Path, step: int, files: dict[str, bytes], *, host: int,
                    num_hosts: int, slice_of_host: int = 0,
                    ranks: tuple[int, ...] = ()) -> dict[str, bytes]:
    """Commit ``files`` as host ``host``'s step the way mtc's sidecar does: with a
    manifest (each file one opaque uint8 leaf) that names the host, so that a replicator
    started with ``--framework mtc`` takes the step as its own (a manifest-less folder
    is not mtc's: it is left alone). ``ranks``: the saving hosts' replicator ranks,
    as the manifest states them (empty: host h is rank h). Returns every file
    committed, the manifest too."""
    leaves = []
    for name, data in sorted(files.items()):
        shard = ShardEntry(index=((0, len(data)),), file=name, nbytes=len(data),
                           crc32c=crc32c(data))
        leaves.append(LeafEntry(path=name, keys=(("d", name),), kind="numpy",
                                shape=(len(data),), dtype="uint8", shards=(shard,)))
    manifest = Manifest(step=step, host=host, slice=slice_of_host, num_hosts=num_hosts,
                        leaves=tuple(leaves), ranks=ranks)
    out = {**files, MANIFEST_NAME: manifest.to_bytes()}
    commit_raw_step(root, step, out)
    return out


def commit_raw_step(root: Path, step: int, files: dict[str, bytes]) -> Path:
    """Commit an opaque step (no manifest: Orbax's) the way a client does: write, then
    rename."""
    tmp = root / f"{step}.test-tmp"
    for rel, data in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    final = root / str(step)
    publish(tmp, final)
    return final


def copies_of(c: MemoryCluster, holder: int, origin: int) -> set[int]:
    """The steps of ``origin`` that ``holder`` holds complete copies of."""
    return {x.step for x in c.inventory(holder).copies if x.origin_rank == origin}

