"""The one map between domain errors and gRPC status codes, both ways, and the
retry rule every loop uses (:func:`is_retryable`).

Server side, :func:`to_status` turns what a handler raised into a code (and
:func:`answer` into the code and message a handler aborts with); client
side, :func:`error_class` names the domain error a code stands for, and
:func:`is_retryable` says whether the same call may succeed later: transport
trouble (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) and retryable domain
errors yes; bad input, missing or corrupt data no.
A call that failed is a :class:`PeerError` to its caller.

Shared by the replicator (its servers and clients) and the controller, which
calls replicators from another machine and retries by :func:`is_retryable`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

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
from mtc.errors import PeerError as PeerError  # defined with every error; imported from here

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
log = logging.getLogger("mtc.sidecar.replicator.wire.server")  # errors as the server's


# An error's step, host and file travel beside its bare message, as trailing
# metadata: the caller's error names them once, instead of the text naming them
# again at every hop it is wrapped in.
# A path may hold any character: it travels as bytes (a "-bin" key).
_WHERE = (("step", "x-mtc-error-step"), ("host", "x-mtc-error-host"),
          ("path", "x-mtc-error-path-bin"))
_WHERE_MAX = 4096  # a path from the network, bounded like every other field


def wire_error(e: BaseException) -> tuple[str, tuple[tuple[str, str | bytes], ...]]:
    """A handler's error as it travels: its message without the where-suffix, and
    its step, host and file as trailing metadata."""
    if isinstance(e, OSError) and not isinstance(e, MtcError):
        # Its text names the file by this host's own path (its RAM disk's): a caller
        # on the network is told the error and the file's name only.
        name = f" ({os.path.basename(str(e.filename))})" if e.filename else ""
        return f"{type(e).__name__}: {e.strerror or 'failed'}{name}", ()
    if not isinstance(e, MtcError):
        return str(e), ()
    where: list[tuple[str, str | bytes]] = []
    for attr, key in _WHERE:
        value = getattr(e, attr)
        if value is not None:
            if attr == "path" and os.path.isabs(str(value)):
                value = os.path.basename(str(value))  # never a folder of this host's
            where.append((key, str(value).encode()[:_WHERE_MAX] if attr == "path"
                          else str(int(value))))
    return e.message, tuple(where)


def where_of(metadata: object) -> dict[str, Any]:
    """The step, host and file a failed call's trailing metadata names (a caller's
    error is built with them); nothing that does not parse."""
    got: dict[str, Any] = {}
    keys = {key: attr for attr, key in _WHERE}
    try:
        items = list(metadata or ())  # type: ignore[call-overload]
    except TypeError:
        return got
    for item in items[:16]:
        try:
            key, value = item
        except (TypeError, ValueError):
            continue
        attr = keys.get(key) if isinstance(key, str) else None
        if attr is None or not isinstance(value, str | bytes) or len(value) > _WHERE_MAX:
            continue
        if attr == "path":
            got[attr] = value.decode(errors="replace") if isinstance(value, bytes) else value
        elif isinstance(value, str) and value.lstrip("-").isdigit() and len(value) < 20:
            got[attr] = int(value)
    return got


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


def answer(e: BaseException, context: grpc.ServicerContext) -> tuple[grpc.StatusCode, str]:
    """What a handler that raised ``e`` answers, through the one map; an unmapped
    error is a bug: logged (as the server's), and
    answered without its message (which may name this server's own folders). A
    mapped error's step, host and file go in the trailing metadata (``wire_error``),
    its message bare."""
    code = to_status(e)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in a replicator call", exc_info=e)
        return code, f"internal error ({type(e).__name__}; the replicator's log has it)"
    message, where = wire_error(e)
    context.set_trailing_metadata(where)
    return code, message
