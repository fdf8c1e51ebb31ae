"""What the manager asks of the hosts it serves: the :class:`Dispatch` protocol.

Every dispatcher (in this process, through colocated Python, through sidecar
processes) offers all of it, so that the manager and its flows never ask which
one they hold. Where a dispatcher cannot answer a question (how many saves are
still being written), it says so in the value it returns (None, or a bound).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import numpy as np

from mtc.contract import LeafSpec, ReadTask, SaveHeader
from mtc.errors import HostAgentError
from mtc.manifest import Manifest
from mtc.operations import Opened

__all__ = ["BeforeSend", "Dispatch", "Opened", "Survey", "WorkerLostError"]


class WorkerLostError(HostAgentError, jax.errors.JaxRuntimeError):
    """A host's worker is gone with its devices: a colocated call's input or answer
    on them cannot be read (the runtime's ``DATA_LOSS``). mtc's error, naming the
    host, for callers that decide by mtc's errors (a manager closing after a
    failure); and still the runtime's error with its message, so that an elastic
    loop (pathwaysutils' ``elastic_retry``) sees the slice-down event it is, not
    an error of its own."""


@dataclasses.dataclass(frozen=True)
class Survey:
    """The hosts' committed steps and what their manifests say of each, as one
    answer: ``held`` by host; ``facts[(step, host)]`` = (hosts that saved it, the
    run that wrote it); ``manifests[host]``: that host's manifest of ``step``;
    ``space[host]``: (bytes free on its RAM disk, bytes of its newest step)."""

    step: int | None
    held: dict[int, list[int]]
    facts: dict[tuple[int, int], tuple[int, str]] = dataclasses.field(default_factory=dict)
    manifests: dict[int, Manifest] = dataclasses.field(default_factory=dict)
    space: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)


# Runs once the hosts' committed steps are known and before a save is sent to any
# host: it may delete steps and free room, or raise (and then nothing is sent).
BeforeSend = Callable[[Survey], None]


class Dispatch(Protocol):
    # -- save ---------------------------------------------------------------------
    def check_before_save(self, due: bool) -> None:
        """Raise an earlier save's background error, as cheaply as this dispatcher
        can (``due``: a save follows at once, which asks the hosts anyway)."""
        ...

    def save(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray],
             hosts: Sequence[int], before_send: BeforeSend) -> bool:
        """Stage a save: the hosts' committed steps are listed, ``before_send`` runs
        on them, then the arrays go to the hosts. False: skipped (``skip_if_busy``)."""
        ...

    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray]) -> bool: ...
    def wait(self) -> None: ...
    def raise_background_error(self) -> None: ...

    def saving(self) -> bool | None:
        """Whether a save is still being written; None: the hosts do not report
        progress (the caller waits for the saves instead)."""
        ...

    def saves_in_flight(self, hosts: Sequence[int]) -> int:
        """Steps still being written on ``hosts`` (an upper bound)."""
        ...

    # -- restore ------------------------------------------------------------------
    def load(self, step: int, tasks: Sequence[ReadTask],
             specs: dict[int, LeafSpec]) -> dict[int, jax.Array]: ...
    def manifest(self, step: int, host: int) -> Manifest: ...
    def read(self, step: int, host: int, tasks: Sequence[ReadTask]) -> list[np.ndarray]: ...
    def own_for(self, step: int) -> tuple[int, ...]: ...
    def network_bytes(self) -> int: ...

    def networked(self) -> bool:
        """Whether this process sees its own host's RAM disk only and gets other
        hosts' manifests and regions over the network tier (multi-controller JAX
        with replicators): a restore then plans on its own host's files first, and
        no one process plans every host."""
        ...

    # -- the hosts' roots ---------------------------------------------------------
    def steps(self, hosts: Sequence[int]) -> dict[int, list[int]]: ...

    def survey(self, hosts: Sequence[int], step: int | None, *,
               manifests: bool = True) -> Survey:
        """The hosts' steps, the facts of each, and (``manifests``) their manifests
        of ``step`` (None: each host's newest), in one request to every host."""
        ...

    def delete(self, step: int, hosts: Sequence[int]) -> None: ...
    def open(self, hosts: Sequence[int], *, read_only: bool,
             identify: bool = False, metadata: str | None = None) -> dict[int, Opened]: ...
    def retain(self, hosts: Sequence[int], complete: Sequence[int], *, max_to_keep: int | None,
               keep_period: int | None, before_write: bool) -> dict[int, tuple[int, int]]: ...
    def space(self, hosts: Sequence[int]) -> dict[int, tuple[int, int]]: ...
    def settle(self, hosts: Sequence[int]) -> None: ...

    def close(self) -> None: ...
