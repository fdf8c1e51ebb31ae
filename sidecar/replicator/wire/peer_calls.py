"""A peer's calls as its data path uses them (:class:`~.client.PeerClient`, typed
by what :mod:`.peer_data`, :mod:`.data_link` and :mod:`.grpc_data_client` use):
the client makes its data path, so the data path names the client by this
protocol rather than importing it back."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from mtc.proto import replicator_pb2 as pb
    from mtc.rank_names import PeerServerName

T = TypeVar("T")


class PeerCalls(Protocol):
    """One peer's replicator: where it is, who it must be, and its calls."""

    address: str
    rank: int
    deadline_s: float
    metadata: list[tuple[str, str]]
    server_name: PeerServerName | None
    # Its data channel's port: None, not known (asked); 0, it has none.
    data_port: int | None

    def call(self, name: str, request: Any, *, deadline_s: float | None = None,
             attempts: int = 3, known_up: bool = False) -> Any: ...

    def retry(self, fn: Callable[[], T], what: str, attempts: int) -> T: ...

    def push_stream(self, chunks: Iterator[bytes], deadline_s: float,
                    metadata: list[tuple[str, str]]) -> pb.PushAck: ...

    def fetch_stream(self, req: pb.FetchRequest, deadline_s: float) -> Iterator[bytes]: ...
