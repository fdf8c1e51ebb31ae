"""One replicator for tests that talk to it over loopback: rank 0 of two (one host
per slice) of the one cluster harness (:class:`MemoryCluster`, its peer, rank 1,
never started: every call to it fails at once), a step of its own committed before
it serves, its gRPC and data-channel servers started with :func:`serve`,
everything closed by :meth:`close`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtc.credentials import Credentials
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.memory_cluster import DEFAULTS, MemoryCluster
from mtc.sidecar.replicator.wire.server import serve

# The replicator's own defaults where the cluster's tests shorten them: a served node
# runs as a deployed one (a restore's quiet time, space set aside, the scrub's
# rate), but for the deadlines below.
AS_DEPLOYED = {f.name: f.default for f in dataclasses.fields(ReplicatorConfig)
               if f.name in DEFAULTS}


class ServedNode:
    """``commit(root)`` writes the step(s) it holds before it serves; ``config``
    overrides the configuration's fields (``framework="orbax"``: opaque step folders)
    and ``serving`` goes to :func:`serve` (``limits=``)."""

    def __init__(self, root: Path, creds: Credentials, commit: Callable[[Path], Any], *,
                 serving: dict[str, Any] | None = None, **config: Any) -> None:
        self.root = root
        self.cluster = MemoryCluster(root.parent, 2, start=False, run=False, creds=creds,
                                     roots={0: root}, **{**AS_DEPLOYED, "deadline_s": 2.0,
                                                         "agreement_timeout_s": 0.5, **config})
        self.node = self.cluster.start(0)
        commit(root)
        self.server, self.port, self.servicer, _ = serve(self.node, "127.0.0.1:0", creds,
                                                         **(serving or {}))

    @property
    def data_port(self) -> int:
        return self.servicer.data_port

    def close(self) -> None:
        self.server.stop(0).wait()
        self.servicer.close()
        self.cluster.close()
