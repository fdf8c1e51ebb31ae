"""The one map between domain errors and gRPC status codes, both ways, and the
retry rule every loop uses (:func:`is_retryable`).

Server side, :func:`to_status` turns what a handler raised into a code; client
side, :func:`error_class` names the domain error a code stands for, and
:func:`is_retryable` says whether the same call may succeed later: transport
trouble (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) and retryable domain
errors yes; bad input, missing or corrupt data no.
"""

from __future__ import annotations

import grpc

from mtc.errors import (
    AgreementError,
    BusyError,
    ConfigError,
    CorruptShardError,
    FatalError,
    MtcError,
    RetryableError,
    StepNotFoundError,
    UnauthorizedError,
)

# Ordered: the first class a raised error is an instance of decides its code.
# (UnsafePathError and other FatalErrors that are bad input fall to INVALID_ARGUMENT.)
_MAP: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (CorruptShardError, grpc.StatusCode.DATA_LOSS),
    (StepNotFoundError, grpc.StatusCode.NOT_FOUND),
    (FileNotFoundError, grpc.StatusCode.NOT_FOUND),
    (KeyError, grpc.StatusCode.NOT_FOUND),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
    (AgreementError, grpc.StatusCode.ABORTED),
    (UnauthorizedError, grpc.StatusCode.PERMISSION_DENIED),
    (BusyError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (FatalError, grpc.StatusCode.INVALID_ARGUMENT),
    (RetryableError, grpc.StatusCode.UNAVAILABLE),
)
# Codes whose call may succeed when simply sent again (gRPC's own or a retryable
# domain error's). ABORTED is AgreementError: retryable, but only by a new
# restore, which callers decide (an agreement that timed out is not resent blindly).
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})
_BY_CODE: dict[grpc.StatusCode, type[MtcError]] = {
    grpc.StatusCode.DATA_LOSS: CorruptShardError,
    grpc.StatusCode.NOT_FOUND: StepNotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: ConfigError,
    grpc.StatusCode.ABORTED: AgreementError,
    grpc.StatusCode.INVALID_ARGUMENT: FatalError,
    grpc.StatusCode.PERMISSION_DENIED: UnauthorizedError,
    grpc.StatusCode.UNAVAILABLE: RetryableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: RetryableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RetryableError,
}


def to_status(e: BaseException) -> grpc.StatusCode:
    """The code a handler's error travels as; INTERNAL for anything unmapped."""
    for cls, code in _MAP:
        if isinstance(e, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_class(code: grpc.StatusCode | None) -> type[MtcError]:
    """The domain error a code stands for (unknown or no code: retryable)."""
    if code is None:
        return RetryableError
    return _BY_CODE.get(code, FatalError)


def is_retryable(e: BaseException) -> bool:
    """Whether the same call may succeed if sent again later."""
    code = getattr(e, "code", None)
    if isinstance(code, grpc.StatusCode) or (code is None and hasattr(e, "unreachable")):
        return code is None or code in TRANSIENT
    if isinstance(e, MtcError):
        return isinstance(e, RetryableError)
    return isinstance(e, OSError | TimeoutError)
