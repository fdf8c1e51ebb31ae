"""The replicator's pure rules beside agreement (no processes): garbage
collection's plan, the one map between mtc's errors and gRPC status codes (and
which are retried), and the health rule of its loop."""

from __future__ import annotations

import grpc
import pytest

from mtc.errors import AgreementError, CorruptShardError, StepNotFoundError
from mtc.sidecar.replicator.client import PeerError
from mtc.sidecar.replicator.gc import GcInputs, GcPlan, gc_plan
from mtc.sidecar.replicator.main import healthy
from mtc.sidecar.replicator.status import error_class, is_retryable, to_status

# -- garbage collection's plan ----------------------------------------------------------


def gc_in(own: tuple[int, ...], replicated: tuple[int, ...] = (), keep: int = 2,
          replicas: dict[int, tuple[int, ...]] | None = None, synced: bool = True,
          busy: frozenset[int] = frozenset()) -> GcInputs:
    return GcInputs(own=own, replicated=replicated, replicas=replicas or {}, keep=keep,
                    busy=busy, synced=synced, linked=frozenset(), rank=0)


GC_CASES = [
    ("nothing to delete", gc_in((4, 5)), None, GcPlan()),
    ("asks for the complete step first", gc_in((1, 2, 3, 4, 5), (1,)), None,
     GcPlan(needs_complete=True)),
    ("keeps newest, replicated, complete", gc_in((1, 2, 3, 4, 5), (1,)), 2, GcPlan((3,))),
    ("not synced: keeps all own", gc_in((1, 2, 3), synced=False), 2, GcPlan()),
    ("busy kept", gc_in((1, 2, 3, 4), busy=frozenset({1})), 3, GcPlan((2,))),
    ("old copies of a peer go, complete kept", gc_in((5,), replicas={1: (2, 3, 4, 5)}), 2,
     GcPlan((), ((1, 3),))),
]


@pytest.mark.parametrize(("name", "x", "complete", "want"), GC_CASES,
                         ids=[c[0] for c in GC_CASES])
def test_gc_plan(name: str, x: GcInputs, complete: int | None, want: GcPlan) -> None:
    assert gc_plan(x, complete) == want


# -- the one status map ---------------------------------------------------------------


def peer_error(code: grpc.StatusCode | None) -> PeerError:
    e = PeerError("x")
    e.code = code
    return e


def test_status_map_both_ways_and_retry_rule() -> None:
    for err, code, back in [
        (CorruptShardError("x"), grpc.StatusCode.DATA_LOSS, CorruptShardError),
        (StepNotFoundError("x"), grpc.StatusCode.NOT_FOUND, StepNotFoundError),
        (AgreementError("x"), grpc.StatusCode.ABORTED, AgreementError),
    ]:
        assert to_status(err) == code
        assert error_class(code) is back
    assert to_status(ValueError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert to_status(RuntimeError("x")) == grpc.StatusCode.INTERNAL
    assert is_retryable(peer_error(grpc.StatusCode.UNAVAILABLE))
    assert is_retryable(peer_error(None))
    assert not is_retryable(peer_error(grpc.StatusCode.INVALID_ARGUMENT))
    assert not is_retryable(peer_error(grpc.StatusCode.DATA_LOSS))
    assert not is_retryable(CorruptShardError("x"))
    assert is_retryable(AgreementError("x"))


def test_health_follows_the_loop() -> None:
    assert healthy(100.0, 101.0, 5.0)
    assert not healthy(100.0, 106.0, 5.0)
