"""Which step folders in a host's root are its own (``<root>/<step>/``): a RAM
disk that outlives its job may hold another rank's steps under the same names,
and an Orbax user's steps beside mtc's. Decided once per folder (by inode)."""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

from mtc import layout
from mtc.manifest import MANIFEST_NAME
from mtc.sidecar.replicator.store.step_files import not_ours

log = logging.getLogger(__name__)


class OwnSteps:
    """The own steps of the host of ``rank`` in ``root``; ``orbax``: serving
    Orbax's client (``--framework orbax``), whose steps carry no manifest."""

    def __init__(self, root: Path, rank: int, *, orbax: bool = False) -> None:
        self.root = root
        self.rank = rank
        self.orbax = orbax
        self._lock = threading.Lock()
        self._owned: dict[int, tuple[int, bool]] = {}  # step -> (inode of <root>/<step>, ours)

    def owns(self, step: int) -> bool:
        """Whether ``<root>/<step>/`` is a step of this host's. A RAM disk that outlives
        its job (GKE's multi-tier checkpointing volume stays with the node) may hold
        another rank's steps under the same names: an mtc step whose manifest names
        another host, or another step, is not this host's, and neither is one whose
        manifest cannot be read (it cannot say whose it is). Those are never
        offered, served, backed up or deleted here. A step without a manifest
        (Orbax's) says nothing of its host: it counts as this host's only for a
        replicator that serves Orbax's client (``--framework orbax``), as that client
        has it; beside mtc it is a folder mtc did not write (an Orbax user's step in
        the same RAM disk), never to be deleted. Decided once per folder (by inode)."""
        d = self.root / str(step)
        try:
            st = os.lstat(d)  # a symlink named as a step is no step: never followed
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            return False
        with self._lock:
            hit = self._owned.get(step)
        if hit is not None and hit[0] == st.st_ino:
            return hit[1]
        try:
            data: bytes | None = (d / MANIFEST_NAME).read_bytes()
            why = not_ours(data, str(d / MANIFEST_NAME), self.rank, step, orbax=self.orbax)
        except FileNotFoundError:
            why = not_ours(None, "", self.rank, step, orbax=self.orbax)
        except OSError as e:
            why = f"its manifest cannot be read ({e.strerror})"
        if why is not None:
            log.warning("rank %d: %s is not this host's step: %s; it is left as it is "
                        "(neither offered, served nor deleted)", self.rank, d, why)
        with self._lock:
            self._owned[step] = (st.st_ino, why is None)
        return why is None

    def steps(self) -> list[int]:
        """This host's committed steps in the root, oldest first."""
        present = layout.committed_steps(self.root)
        with self._lock:  # forget folders gone (the sidecar's retention removes them too)
            for gone in self._owned.keys() - set(present):
                del self._owned[gone]
        return [s for s in present if self.owns(s)]
