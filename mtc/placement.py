"""Where each host's steps are copied: the placement rule the replicators follow and
the controller (``mtc.testing``'s ``wait_replicated``) reads.

Ranks are ordered slice by slice: rank ``r`` is host ``r % nodes_per_slice`` of
slice ``r // nodes_per_slice``. A host's peer group is the hosts with the same
in-slice index in every other slice (the hosts holding the same data-parallel
shards). Each step is copied to the next ``replicas`` members of the peer group,
going round the slices: with 2 slices and ``replicas=1``, host i of slice 0 and
host i of slice 1 hold each other's steps.
"""

from __future__ import annotations


def peer_group(rank: int, num_nodes: int, nodes_per_slice: int) -> list[int]:
    """Ranks with ``rank``'s in-slice index, ``rank`` first, then slice by slice after it."""
    i, s = rank % nodes_per_slice, rank // nodes_per_slice
    num_slices = num_nodes // nodes_per_slice
    return [((s + k) % num_slices) * nodes_per_slice + i for k in range(num_slices)]


def targets(rank: int, num_nodes: int, nodes_per_slice: int, replicas: int = 1) -> list[int]:
    """Where ``rank``'s steps are copied: the next ``replicas`` members of its peer
    group. A step is replicated when it is on every one of them (what the
    replicator reports, and what mtc.testing's wait_replicated waits for)."""
    return peer_group(rank, num_nodes, nodes_per_slice)[1:1 + replicas]
