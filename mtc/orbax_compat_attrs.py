"""Orbax's private ``CheckpointManager`` attributes, read-only, with Orbax's meaning.

Kept for code that reads Orbax's private attributes (its own tests do, and so does
user code that copied them): ``_default_item``, ``_root_metadata_file_path()`` and
``_checkpoints``. Each answers from what mtc knows; none can change what mtc does
(``_checkpoints``' entries are frozen: Orbax's tests that set a step's ``time``
there to steer retention get an error, not a silently ignored write). New code
should use the public calls each one names.
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtc.contract import AgentConfig
    from mtc.save.flow import SaveFlow


class DefaultItem:
    """Orbax's ``_default_item`` (a ``threading_lib.OptionalRef[bool]``), read-only:
    ``get()`` is whether the manager saves one unnamed item (True), the items of a
    ``Composite`` (False), or is not yet known (None: no ``item_names``/handlers
    given, and no save, restore or step metadata read yet, which lock it in, as
    Orbax's)."""

    __slots__ = ("_manager",)

    def __init__(self, manager: OrbaxPrivateAttrs) -> None:
        self._manager = manager

    def get(self) -> bool | None:
        composite = self._manager._composite
        return None if composite is None else not composite

    def __repr__(self) -> str:
        return f"DefaultItem({self.get()!r})"


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """Orbax's ``CheckpointInfo`` of a step, frozen: its number, when its save began
    (a UTC ``datetime``; None where no time is known) and its metrics (None: none)."""

    step: int
    time: datetime.datetime | None
    metrics: Any


class OrbaxPrivateAttrs:
    """The attributes, on :class:`mtc.CheckpointManager` (a base class of it)."""

    if TYPE_CHECKING:  # what the manager has, read here
        _composite: bool | None
        _metadata_host: int | None
        _config: AgentConfig
        _saves: SaveFlow

        def _roots_here(self) -> str: ...

        def all_steps(self) -> list[int]: ...

        def metrics(self, step: Any) -> Any: ...

    @property
    def _default_item(self) -> DefaultItem:
        """Orbax's ``_default_item``: see :class:`DefaultItem`."""
        return DefaultItem(self)

    def _root_metadata_file_path(self, legacy: bool = False) -> Path:
        """Orbax's: the file the root metadata is kept in (``metadata()`` reads it): on
        the root of the first host this process serves that keeps it. A ``ValueError``
        where none is kept (no ``metadata=`` given to a writing manager, a read-only
        manager's, ``save_root_metadata=False``), as Orbax's."""
        if legacy:
            raise ValueError("mtc keeps no legacy root metadata file (Orbax's 'metadata' "
                             "item); the root metadata is in _root_metadata_file_path()")
        if self._metadata_host is None:
            raise ValueError(f"Root Metadata directory is not initialized: no root metadata "
                             f"is kept in {self._roots_here()}")
        from mtc import layout

        return self._config.root(self._metadata_host) / layout.ROOT_METADATA_NAME

    @property
    def _checkpoints(self) -> tuple[CheckpointInfo, ...]:
        """Orbax's ``_checkpoints``: a :class:`CheckpointInfo` per step ``all_steps()``
        lists, oldest first (read-only; each access asks again)."""
        out = []
        for step in self.all_steps():
            saved_at = self._saves._time_of(step)
            out.append(CheckpointInfo(
                step, None if saved_at is None else
                datetime.datetime.fromtimestamp(saved_at, datetime.UTC),
                self.metrics(step)))
        return tuple(out)
