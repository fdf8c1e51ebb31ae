"""What a replicator checks of itself and says about it: that its configuration
agrees with its peers' (:func:`disagreement`, asked of every peer once at start
by :func:`check_peers`), which peers do not answer it (:class:`PeerReach`: a
wrong address in ``--nodes``, where nobody listens, shows at once), and how long
its newest own step has waited to reach every target (:class:`ReplicationClock`).
All show in its identity (``GetInventory(identify=true)``), which ``mtc status``
and the managers read.

A node whose configuration disagrees with a peer's (the node at a place of its
``--nodes`` is another rank: a wrong ``--rank``, lists in another order; another
number of nodes; another ``--nodes-per-slice``) would copy steps to the wrong
peers and agree on restores with the wrong members: it refuses restores
(``ConfigError``) and pushes until it is restarted with flags that agree. The
address strings themselves are not compared: a node may reach the same peer by
another address than its neighbours do (its own loopback, a link of its own).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from mtc.errors import ConfigError
from mtc.grpc_errors import PeerError
from mtc.lifecycle import Threads
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.transport import Peer

log = logging.getLogger("mtc.replicator")
RETRY_S = 1.0  # between asks of a peer that has not answered yet
# A peer unanswered this long is a fault in the identity (mtc status, the managers'
# logs): a few asks, so that peers started a moment apart are not one.
PEER_GRACE_S = 3.0


def disagreement(config: ReplicatorConfig, peer: int, reply: pb.Inventory) -> str:
    """How peer ``peer``'s identity (its answer to ``identify``) disagrees with this
    node's configuration; "" when it agrees, or predates the question. Pure."""
    if not reply.config.nodes:
        return ""  # an older replicator: it cannot say
    problems = []
    if reply.rank != peer:
        problems.append(f"the node at {config.nodes[peer]} (rank {peer} in this node's "
                        f"--nodes) says it is rank {reply.rank}")
    if len(reply.config.nodes) != len(config.nodes):
        problems.append(f"rank {peer}'s --nodes lists {len(reply.config.nodes)} nodes, this "
                        f"node's {len(config.nodes)}")
    if reply.config.nodes_per_slice != config.nodes_per_slice:
        problems.append(f"rank {peer}'s --nodes-per-slice is "
                        f"{reply.config.nodes_per_slice}, this node's "
                        f"{config.nodes_per_slice}")
    return "; ".join(problems)


class ReplicationClock:
    """Since when this node's newest own steps have waited to be on every target.

    The clock starts when an own step is found not fully replicated and stops
    only when the newest one is: a job saving a new step every few seconds while
    nothing reaches its peer is late however often the newest step changes. Only
    the replication loop's thread calls :meth:`update`; readers get a snapshot."""

    def __init__(self, warn_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.warn_s = warn_s
        self._clock = clock
        self._since: float | None = None
        self._step = -1
        self._warned = -1  # the step a warning was logged for

    def update(self, newest: int, replicated: bool) -> None:
        if replicated:
            self._since, self._step = None, -1
            return
        if self._since is None:
            self._since = self._clock()
        self._step = newest

    def state(self) -> tuple[int, float, bool]:
        """(the newest own step waiting, seconds waited, late); (-1, 0, False) when
        every own step is on its targets."""
        if self._since is None:
            return -1, 0.0, False
        waited = self._clock() - self._since
        return self._step, waited, waited > self.warn_s

    def warn_once(self) -> str:
        """A warning to log when replication is late, once per step; "" otherwise."""
        step, waited, late = self.state()
        if not late or step == self._warned:
            return ""
        self._warned = step
        return (f"step {step} is not on every peer: this host's steps have not reached "
                f"them for {waited:.0f}s, and a loss of this host now loses them")


class PeerReach:
    """The peers that have not answered this node since they last did: since when
    and why. Written by the start-up check (every peer, until each answered once)
    and by replication (its targets, every few seconds); read for the identity.
    Threads: any, under one lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._since: dict[int, float] = {}
        self._error: dict[int, str] = {}

    def failed(self, peer: int, error: str) -> None:
        with self._lock:
            self._since.setdefault(peer, self._clock())
            self._error[peer] = error[:500]  # a peer's message: bounded like any other

    def answered(self, peer: int) -> None:
        with self._lock:
            self._since.pop(peer, None)
            self._error.pop(peer, None)

    def faults(self, grace_s: float) -> list[tuple[int, float, str]]:
        """(peer, seconds unanswered, last error) of each peer unanswered for longer
        than ``grace_s`` (a peer starting a moment after this node is not a fault)."""
        now = self._clock()
        with self._lock:
            return [(p, now - t, self._error[p]) for p, t in sorted(self._since.items())
                    if now - t >= grace_s]


class Asks(Protocol):
    def __call__(self, peer: int) -> pb.Inventory | None: ...


def check_peers(config: ReplicatorConfig, ask: Asks, report: Callable[[str], None],
                stop: threading.Event, peers: Sequence[int] | None = None) -> None:
    """Ask every peer for its identity (``ask(peer)``: None while it does not
    answer) until each has answered once, or ``stop``; ``report`` what disagrees
    (once per peer that does). Runs on :class:`ConfigCheck`'s thread."""
    waiting = list(range(config.num_nodes) if peers is None else peers)
    waiting = [p for p in waiting if p != config.rank]
    while waiting and not stop.is_set():
        for peer in list(waiting):
            reply = ask(peer)
            if reply is None:
                continue
            waiting.remove(peer)
            problem = disagreement(config, peer, reply)
            if problem:
                report(problem)
        if waiting:
            stop.wait(RETRY_S)


def identify(client: Peer, reach: PeerReach, peer: int) -> pb.Inventory | None:
    """Peer ``peer``'s identity, or None while it does not answer (noted in ``reach``)."""
    try:
        reply = client.inventory(pb.InventoryRequest(identify=True), attempts=1,
                                 deadline_s=5.0)
    except PeerError as e:
        if e.unreachable:
            reach.failed(peer, e.message)
        else:
            reach.answered(peer)  # a refusal (a token it does not take) is an answer
        return None
    reach.answered(peer)
    return reply


class ConfigCheck:
    """Whether this node's configuration disagrees with a peer's, and the start-up
    check that finds out (:func:`check_peers` on a thread of its own), a service
    (:class:`mtc.lifecycle.Service`). ``error``: what disagrees, "" while nothing
    does; while set, the node refuses restores and copies nothing."""

    def __init__(self, config: ReplicatorConfig, ask: Asks,
                 on_mismatch: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.error = ""
        self._ask = ask
        self._on_mismatch = on_mismatch
        self._stop = threading.Event()

    def disagrees(self, problem: str) -> None:
        """A peer's configuration disagrees with this node's."""
        self.error = "; ".join(filter(None, [self.error, problem]))
        self._on_mismatch()
        log.error("rank %d: configuration disagrees with a peer's (%s): this node refuses "
                  "restores and copies nothing until every replicator runs with the same "
                  "--nodes and --nodes-per-slice and its own --rank", self.config.rank,
                  problem)

    def refuse_if_misconfigured(self) -> None:
        if self.error:
            raise ConfigError(f"replicator configuration disagrees with a peer's: "
                              f"{self.error}", host=self.config.rank)

    def start(self, threads: Threads) -> None:
        threads.start(check_peers, "mtc-config-check", self.config, self._ask,
                      self.disagrees, self._stop)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        pass
