"""The controller's channels to the sidecars (mtc.dispatch.process.channels) and the
replicators' channels to their peers (wire.client.CHANNEL_OPTIONS): a server slow
to answer its first HTTP/2 frame, as one on a loaded machine or just started is,
is waited for, not failed. gRPC gives a connection attempt no longer
than ``grpc.min_reconnect_backoff_ms``: at 100 ms, a clean-clone run's manager
failed its first call to a restarted sidecar ("connection attempt timed out before
receiving SETTINGS frame"). Here a real gRPC server sits behind a TCP relay that
holds each new connection's first bytes back for half a second."""

from __future__ import annotations

import socket
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from mtc.dispatch.process import Sidecar, channels
from mtc.pool import ThreadPool
from mtc.sidecar.replicator.wire.client import CHANNEL_OPTIONS

METHOD = "/mtc.test.Echo/Echo"
HOLD_S = 0.5


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _sidecar_channel(address: str) -> tuple[grpc.Channel, Any]:
    chans, stubs = channels({0: Sidecar(address, Path())}, METHOD)
    return chans[0], stubs[0]


def _peer_channel(address: str) -> tuple[grpc.Channel, Any]:
    chan = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return chan, chan.unary_unary(METHOD, request_serializer=None,
                                  response_deserializer=None)


@pytest.mark.parametrize("make", [_sidecar_channel, _peer_channel],
                         ids=["sidecar", "replicator-peer"])
def test_a_server_slow_to_answer_its_first_frame_is_waited_for(make: Any) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "mtc.test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(
            lambda req, ctx: b"echo:" + req)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    relay = socket.create_server(("127.0.0.1", 0))
    relay.settimeout(10)
    pool = ThreadPool(5, "test-relay", lazy=True)

    def accept_one() -> None:
        conn, _ = relay.accept()
        time.sleep(HOLD_S)  # the relay holds the new connection, as a busy sidecar does
        back = socket.create_connection(("127.0.0.1", port))
        pool.submit(_pump, conn, back)
        _pump(back, conn)

    accepted = pool.submit(accept_one)
    chan, stub = make(f"127.0.0.1:{relay.getsockname()[1]}")
    try:
        assert stub(b"hi", timeout=10) == b"echo:hi"
    finally:
        chan.close()
        server.stop(None)
        accepted.result(timeout=10)
        pool.shutdown(wait=True)
        relay.close()
