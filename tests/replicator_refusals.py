"""How a replicator refused a call, and that it still serves afterwards: the
checks the replicator security tests share (``tests/test_replicator_security.py``
and ``tests/test_replicator_requests.py``)."""

from __future__ import annotations

import grpc
from replicators import Cluster


def code_of(e: BaseException | None) -> grpc.StatusCode | None:
    """The status code of an RpcError, or of the RpcError behind a PeerError."""
    while e is not None and not isinstance(e, grpc.RpcError):
        e = e.__cause__
    return e.code() if e is not None else None


def assert_serving(cl: Cluster, rank: int) -> None:
    assert cl.alive(rank), cl.log_text(rank)[-2000:]
    cl.inventory(rank)  # answers a real call
