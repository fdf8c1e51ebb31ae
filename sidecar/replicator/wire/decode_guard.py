"""Malformed requests are the caller's error: INVALID_ARGUMENT, not INTERNAL.

gRPC decodes a protobuf request before any handler runs, and answers a message
that does not decode with INTERNAL ("Exception deserializing request!"), which
says the server failed. This interceptor makes decoding tolerant and has the
handler refuse the request with INVALID_ARGUMENT instead (found by fuzzing,
tests/test_fuzz_grpc.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

_HEALTH = "/grpc.health.v1.Health/"


class _Malformed:
    def __init__(self, error: Exception) -> None:
        self.error = error


def _refuse(context: grpc.ServicerContext, bad: _Malformed) -> None:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                  f"malformed request: {type(bad.error).__name__}: {bad.error}"[:300])


class DecodeGuard(grpc.ServerInterceptor):
    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: Any) -> Any:
        h = continuation(handler_call_details)
        if h is None or h.request_deserializer is None or h.request_streaming:
            return h  # raw-bytes handlers decode nothing; streams of protobufs: none here
        if getattr(handler_call_details, "method", "").startswith(_HEALTH):
            # Untouched: rewrapped, Watch would lose its non-blocking mark and hold a
            # server thread for as long as a caller keeps it open.
            return h
        decode = h.request_deserializer

        def tolerant(data: bytes) -> Any:
            try:
                return decode(data)
            except Exception as e:  # noqa: BLE001 -- whatever the decoder raises
                return _Malformed(e)

        if h.unary_unary is not None:
            inner_uu = h.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    _refuse(context, request)
                return inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=tolerant,
                response_serializer=h.response_serializer)
        inner_us = h.unary_stream

        def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if isinstance(request, _Malformed):
                _refuse(context, request)
            yield from inner_us(request, context)

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, request_deserializer=tolerant,
            response_serializer=h.response_serializer)
