"""The store as :mod:`.claims` uses it, typed by what it does: :mod:`.store`
imports :mod:`.claims` (a held copy's bad files put back from identical ones), so
:mod:`.claims` names the store by this protocol, not by importing it back."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mtc.manifest import Summary
    from mtc.sidecar.replicator.store.checksums import Checksums
    from mtc.sidecar.replicator.store.copy_proofs import HeldProofs
    from mtc.sidecar.replicator.store.step_files import FileMeta


class Holding(Protocol):
    """:class:`~mtc.sidecar.replicator.store.store.LocalStore`, as far as claims reach."""

    rank: int
    checksums: Checksums
    proofs: HeldProofs
    signed_only: bool

    def copies(self) -> list[tuple[int, int]]: ...

    def copy_dir(self, origin: int, step: int) -> Path: ...

    def describe(self, origin: int, step: int) -> list[FileMeta]: ...

    def summary(self, origin: int, step: int) -> Summary: ...

    def verify(self, origin: int, step: int, *, cached: bool = True) -> list[FileMeta]: ...

    def quarantine_file(self, path: Path, why: str, *, origin: int | None = None,
                        step: int | None = None) -> None: ...

    def begin_incoming(self, origin: int, step: int) -> Path: ...
