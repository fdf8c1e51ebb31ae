"""The replicator's pure rules beside agreement and its policies (no processes):
the one map between mtc's errors and gRPC status codes (and which are retried),
and the health rule of its loop. Garbage collection's plan is tested with the
other policies (tests/test_policies.py)."""

from __future__ import annotations

import grpc

from mtc.errors import AgreementError, CorruptShardError, StepNotFoundError
from mtc.grpc_errors import PeerError, error_class, is_retryable, to_status
from mtc.sidecar.replicator.main import healthy

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
