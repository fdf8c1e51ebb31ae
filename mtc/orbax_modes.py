"""Orbax's two modes of a manager and its root metadata, on mtc's
:class:`mtc.CheckpointManager` (a base class of it).

A manager saves either the items of a ``Composite`` (``item_names``, or a first
save of one) or one unnamed item (one handler given, or a first save of one);
Orbax refuses, with a ``ValueError``, args of the other kind, and a restore or a
step's metadata fixes the mode where no save did. The root metadata
(``metadata=``) is the first writing manager's, kept as JSON on the hosts.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from mtc import orbax_args, orbax_handlers
from mtc.errors import ConfigError

if TYPE_CHECKING:
    from mtc.restore.step import StepReader

log = logging.getLogger("mtc.manager")


class OrbaxItemModes:
    """The mode checks, on the manager."""

    if TYPE_CHECKING:  # what the manager has, read here
        _composite: bool | None
        _handlers: Any
        item_names: tuple[str, ...] | None
        _reader: StepReader

    def _check_mode(self, args: Any, call: str) -> bool | None:
        """Whether Orbax ``args`` are a Composite (None: not Orbax's args), refused with
        a ConfigError (a ValueError, as Orbax's) where they do not fit the manager's
        mode, or (saving) name an item outside ``item_names``."""
        if args is None or not orbax_args.is_orbax_args(args):
            return None
        composite = orbax_args.composite_items(args) is not None
        orbax_handlers.check(self._handlers, args, call)
        if self._composite is not None and composite != self._composite:
            raise ConfigError(
                f"{call}(): Must provide `args` of type `Composite` when dealing with multiple "
                f"checkpointable objects (this manager's items: "
                f"{', '.join(self.item_names) if self.item_names else 'its first save'})"
                if self._composite else
                f"{call}(): Cannot provide `args` of type `Composite` when dealing with a "
                f"single, unnamed (default) checkpointable object (this manager saves one "
                f"item: {'its handler' if self._handlers else 'its first save'}): pass that "
                f"item's args, not a Composite, or give item_names")
        if call == "save" and composite and self.item_names:
            unknown = [str(k) for k in args.keys() if k not in self.item_names]
            if unknown:
                raise ConfigError(f"save(): Composite item {unknown[0]!r} does not match with "
                                  f"any registered handler: item_names are "
                                  f"{list(self.item_names)}")
        return composite

    def _mode_from_step(self) -> None:
        """Orbax's lock-in: a manager whose mode no save set takes it from the step it
        restored or described (one item, or a Composite), as Orbax's restore and
        metadata do; a later save or restore of the other kind is then refused."""
        if self._composite is None and self._reader.saved_composite is not None:
            self._composite = self._reader.saved_composite


def json_of(value: Any, name: str) -> str | None:
    """Orbax's metadata (``metadata=``, ``custom_metadata=``) as the JSON text mtc keeps."""
    if value is None:
        return None
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name} is kept as JSON: plain values (dicts, lists, numbers, "
                          f"strings), got {e}") from e


def root_metadata(opened: dict[Any, Any], given: Any, where: str) -> tuple[Any, int | None]:
    """The root metadata this manager reports, and the first host served that keeps
    it (Orbax's ``_root_metadata_file_path()``): the first writer's, kept on the
    hosts (``opened``: each host's answer to the open); a reader's is its own
    (``given``) until a writer keeps one."""
    kept = next((o.metadata for _, o in sorted(opened.items()) if o.metadata), "")
    host = next((int(h) for h, o in sorted(opened.items()) if o.metadata), None)
    value = given if given is not None else {}
    if kept:
        try:
            value = json.loads(kept)
        except ValueError:  # a damaged file must not keep the directory from opening
            log.warning("mtc: the root metadata kept in %s is not JSON: ignored", where)
    return value, host
