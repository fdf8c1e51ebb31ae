"""What every dispatcher offers (:class:`Dispatch`), and the small host operations as
typed calls over one request/reply channel (:class:`HostCalls`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from mtc.contract import LeafSpec, ReadTask, SaveHeader, task_to_json
from mtc.errors import HostAgentError, ManifestError
from mtc.manifest import MANIFEST_NAME, Manifest


class Dispatch(Protocol):
    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray]) -> bool: ...
    def wait(self) -> None: ...
    def raise_background_error(self) -> None: ...
    def load(self, step: int, tasks: Sequence[ReadTask],
             specs: dict[int, LeafSpec]) -> dict[int, jax.Array]: ...
    def steps(self, hosts: Sequence[int]) -> dict[int, list[int]]: ...
    def manifest(self, step: int, host: int) -> Manifest: ...
    def read(self, step: int, host: int, task: ReadTask) -> np.ndarray: ...
    def delete(self, step: int, hosts: Sequence[int]) -> None: ...
    def retain(self, oldest_kept: int, hosts: Sequence[int]) -> None: ...
    def clean(self, hosts: Sequence[int]) -> dict[int, list[str]]: ...
    def close(self) -> None: ...


class HostCalls:
    """The small host operations, as typed calls over one request/reply channel."""

    def _call(self, op: str, hosts: Sequence[int], **args: Any) -> list[Any]:
        """Every answering host process's decoded reply (typed errors raised)."""
        raise NotImplementedError

    def steps(self, hosts: Sequence[int]) -> dict[int, list[int]]:
        """Committed steps of every host reachable (``hosts``, and with host
        subfolders the roots beside them)."""
        out: dict[int, list[int]] = {}
        for reply in self._call("steps", hosts):
            for h, steps in (reply or {}).items():
                out[int(h)] = [int(s) for s in steps]
        return out

    def _one(self, op: str, host: int, **args: Any) -> Any:
        found = [r for r in self._call(op, [host], **args) if r is not None]
        if len(found) != 1:
            raise HostAgentError(f"{op}: {len(found)} host processes answered for one host",
                                 host=host)
        return found[0]

    def manifest(self, step: int, host: int) -> Manifest:
        path = f"host {host}: {step}/{MANIFEST_NAME}"
        m = Manifest.from_bytes(self._one("manifest", host, step=step), path=path)
        if m.step != step or m.host != host:
            raise ManifestError(f"manifest belongs to step {m.step} host {m.host}", step=step,
                                host=host, path=path)
        return m

    def read(self, step: int, host: int, task: ReadTask) -> np.ndarray:
        """A region of one leaf from pieces ``host`` holds, verified there; a copy."""
        raw = self._one("read", host, step=step, task=task_to_json(task))
        return np.frombuffer(bytearray(raw), dtype=jax.numpy.dtype(task.dtype)).reshape(
            task.shape)

    def delete(self, step: int, hosts: Sequence[int]) -> None:
        self._call("delete", hosts, step=step)

    def retain(self, oldest_kept: int, hosts: Sequence[int]) -> None:
        """Remove every committed step older than ``oldest_kept`` on ``hosts``."""
        self._call("retain", hosts, oldest_kept=oldest_kept)

    def clean(self, hosts: Sequence[int]) -> dict[int, list[str]]:
        """Remove uncommitted and half-deleted folders; their names by host."""
        out: dict[int, list[str]] = {}
        for reply in self._call("clean", hosts):
            for h, names in (reply or {}).items():
                out[int(h)] = list(names)
        return out
