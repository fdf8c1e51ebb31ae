"""One in-process replicator for tests that talk to it over loopback: rank 0 of two
(one host per slice), a step of its own committed before it serves, its gRPC and
data-channel servers started with :func:`serve`, everything closed by :meth:`close`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtc.credentials import Credentials
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.node import Node
from mtc.sidecar.replicator.wire.server import serve


class ServedNode:
    """``commit(root)`` writes the step(s) it holds before it serves; ``config``
    overrides the configuration's fields (``framework="orbax"``: opaque step folders)
    and ``serving`` goes to :func:`serve` (``limits=``)."""

    def __init__(self, root: Path, creds: Credentials, commit: Callable[[Path], Any], *,
                 serving: dict[str, Any] | None = None, **config: Any) -> None:
        cfg = ReplicatorConfig(**{"rank": 0, "nodes": ("127.0.0.1:0", "127.0.0.1:1"),
                                  "nodes_per_slice": 1, "deadline_s": 2.0,
                                  "agreement_timeout_s": 0.5, **config})
        self.root = root
        self.node = Node(cfg, root, creds)
        commit(root)
        self.server, self.port, self.servicer, _ = serve(self.node, "127.0.0.1:0", creds,
                                                         **(serving or {}))

    @property
    def data_port(self) -> int:
        return self.servicer.data_port

    def close(self) -> None:
        self.server.stop(0).wait()
        self.servicer.close()
        self.node.stop()
        self.node.close()
