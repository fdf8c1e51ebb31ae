"""What a replicator checks of itself and says about it: that its configuration
agrees with its peers' (:func:`disagreement`, asked of every peer once at start
by :func:`check_peers`), and how long its newest own step has waited to reach
every target (:class:`ReplicationClock`). Both show in its identity
(``GetInventory(identify=true)``), which ``mtc status`` and the managers read.

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

from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.config import ReplicatorConfig

log = logging.getLogger("mtc.replicator")
RETRY_S = 1.0  # between asks of a peer that has not answered yet


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


class Asks(Protocol):
    def __call__(self, peer: int) -> pb.Inventory | None: ...


def check_peers(config: ReplicatorConfig, ask: Asks, report: Callable[[str], None],
                stop: threading.Event, peers: Sequence[int] | None = None) -> None:
    """Ask every peer for its identity (``ask(peer)``: None while it does not
    answer) until each has answered once, or ``stop``; ``report`` what disagrees
    (once per peer that does). Runs on a thread of main's."""
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
