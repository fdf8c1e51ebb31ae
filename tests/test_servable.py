"""What a holder may serve of a fetch (``sidecar/replicator/copies/servable.py``).

The rule alone, as a table; then both fetch paths of a real replicator server in
this process, on loopback, the data channel (``wire/data_service.py``) and gRPC's
Data service (``wire/grpc_data.py``): each bad request is refused by both with the
same code and message, and before a byte of it is sent.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from replicators import commit_raw_step
from served_node import ServedNode

from mtc.credentials import TOKEN_HEADER, Credentials
from mtc.errors import ConfigError, StepNotFoundError
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.copies.servable import HELD, STAGED, Serving, servable
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.replicator.wire import datachannel as dc
from mtc.sidecar.replicator.wire.client import FETCH

A, B = FileMeta("a.bin", 3, 7), FileMeta("d/b.bin", 5, 9)
COPY = [A, B]

# (origin, paths, held, staged) -> what is served, or the error refusing it. The
# holder is rank 0.
TABLE: list[tuple[int, list[str], list[FileMeta] | None, set[str] | None,
                  Serving | type[Exception]]] = [
    # A copy held here: its described files, in the request's order.
    (1, ["d/b.bin", "a.bin"], COPY, None, Serving(HELD, (B, A))),
    (0, ["a.bin"], COPY, None, Serving(HELD, (A,))),       # an own step, held
    (0, ["a.bin"], COPY, {"a.bin"}, Serving(HELD, (A,))),  # held goes first
    # A path the copy does not describe refuses the whole request, wherever it is.
    (1, ["a.bin", "nope.bin"], COPY, None, FileNotFoundError),
    (1, ["nope.bin", "a.bin"], COPY, None, FileNotFoundError),
    # Not held: another rank's step is not here, whatever this host restores.
    (1, ["a.bin"], None, None, StepNotFoundError),
    (1, ["a.bin"], None, {"a.bin"}, StepNotFoundError),
    # This host's own step, restored from the backup: only the files verified so far,
    # one or several.
    (0, ["a.bin"], None, {"a.bin"}, Serving(STAGED)),
    (0, ["a.bin", "d/b.bin"], None, {"a.bin", "d/b.bin"}, Serving(STAGED)),
    (0, ["a.bin", "d/b.bin"], None, {"a.bin"}, StepNotFoundError),
    # Its own step it neither holds nor restores: the asker reads the backup itself.
    (0, ["a.bin"], None, None, ConfigError),
]


@pytest.mark.parametrize(("origin", "paths", "held", "staged", "want"), TABLE)
def test_the_rule(origin: int, paths: list[str], held: list[FileMeta] | None,
                  staged: set[str] | None, want: Serving | type[Exception]) -> None:
    if isinstance(want, Serving):
        assert servable(origin, 4, paths, rank=0, held=held, staged=staged) == want
    else:
        with pytest.raises(want):
            servable(origin, 4, paths, rank=0, held=held, staged=staged)


TOKEN = "s3cret"
FILES = {"a.bin": b"A" * 4096, "d/b.bin": b"B" * 10}


class Holder(ServedNode):
    """Rank 0 of two, holding step 1 of its own, served on loopback."""

    def __init__(self, base: Path) -> None:
        super().__init__(base / "root", Credentials(token=TOKEN),
                         lambda root: commit_raw_step(root, 1, FILES), framework="orbax")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def over_data_channel(self, req: pb.FetchRequest) -> tuple[grpc.StatusCode | None, str]:
        """The data channel's first answer to ``req``: its code (None: the files follow)."""
        with socket.create_connection(("127.0.0.1", self.servicer.data_port), timeout=5) as s:
            data = pb.DataRequest(token=TOKEN, fetch=req).SerializeToString()
            s.sendall(dc.MAGIC + struct.pack("<I", len(data)) + data)
            st = dc.recv_msg(s, pb.DataStatus, dc.MAX_STATUS)
        return dc.status_code(st), st.message

    def over_grpc(self, req: pb.FetchRequest) -> tuple[grpc.StatusCode | None, str, int]:
        """gRPC's answer to ``req``: its code and message, and the bytes sent before it."""
        got = 0
        try:
            for chunk in self.channel.unary_stream(FETCH)(
                    req.SerializeToString(), metadata=[(TOKEN_HEADER, TOKEN)], timeout=5):
                got += len(chunk)
        except grpc.RpcError as e:
            return e.code(), e.details() or "", got
        return None, "", got

    def close(self) -> None:
        self.channel.close()
        super().close()


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Holder]:
    h = Holder(tmp_path)
    yield h
    h.close()


BAD = {
    "a path the copy does not hold": (pb.FetchRequest(step=1, origin_rank=0, path="nope.bin"),
                                      grpc.StatusCode.NOT_FOUND),
    # The gRPC path used to send a.bin whole before it found nope.bin missing.
    "a later path the copy does not hold": (
        pb.FetchRequest(step=1, origin_rank=0, path="a.bin", more_paths=["nope.bin"]),
        grpc.StatusCode.NOT_FOUND),
    "another rank's step not held": (pb.FetchRequest(step=1, origin_rank=1, path="a.bin"),
                                     grpc.StatusCode.NOT_FOUND),
    "an own step neither held nor restored": (
        pb.FetchRequest(step=2, origin_rank=0, path="a.bin", more_paths=["d/b.bin"]),
        grpc.StatusCode.FAILED_PRECONDITION),
}


def test_both_fetch_paths_refuse_the_same_requests_before_sending(holder: Holder) -> None:
    good = pb.FetchRequest(step=1, origin_rank=0, path="a.bin", more_paths=["d/b.bin"])
    # The same request, asked well, is served by both (the refusals below are the rule's).
    assert holder.over_data_channel(good)[0] == grpc.StatusCode.OK
    assert holder.over_grpc(good) == (None, "", sum(map(len, FILES.values())))
    for what, (req, code) in BAD.items():
        channel_code, channel_msg = holder.over_data_channel(req)
        grpc_code, grpc_msg, sent = holder.over_grpc(req)
        assert channel_code == grpc_code == code, what
        assert channel_msg == grpc_msg, what
        assert sent == 0, what
