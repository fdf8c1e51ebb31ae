"""Orbax's ``item_handlers``, as mtc reads them.

mtc saves an item by the ``ocp.args`` object it is given and runs no handler. An
Orbax user's ``CheckpointManager(directory, item_handlers=...)`` still runs
unchanged: the handlers name the items (a dict of them is ``item_names``), say
whether the manager holds one item or a ``Composite`` of them, and which args
each item takes, so that a save or restore with args another handler reads is
refused at once, as Orbax refuses it. Only Orbax's own handlers of the four kinds
mtc saves are accepted: one of the user's own would not be run, and silently
saving its item another way is refused. Handlers are recognised by class name
(with an ``orbax.`` module): Orbax is not imported.
"""

from __future__ import annotations

from typing import Any

from mtc.errors import ConfigError
from mtc.orbax_args import composite_items, is_orbax_args

# An Orbax handler's class -> the ocp.args classes it saves and restores.
HANDLER_ARGS = {
    "StandardCheckpointHandler": ("StandardSaveArgs", "StandardRestoreArgs"),
    "PyTreeCheckpointHandler": ("PyTreeSaveArgs", "PyTreeRestoreArgs"),
    "JsonCheckpointHandler": ("JsonSaveArgs", "JsonRestoreArgs"),
    "ArrayCheckpointHandler": ("ArraySaveArgs", "ArrayRestoreArgs"),
}

# item name (None: the manager's one item) -> its handler's class name
Kinds = dict[str | None, str]


def _kind(item: str | None, handler: Any) -> str:
    cls = type(handler)
    if cls.__name__ in HANDLER_ARGS and cls.__module__.startswith("orbax."):
        return cls.__name__
    where = "item_handlers" if item is None else f"item_handlers[{item!r}]"
    raise ConfigError(
        f"{where}: {cls.__module__}.{cls.__name__} is not a handler mtc reads: mtc saves "
        f"each item by its ocp.args (StandardSave, PyTreeSave, JsonSave, ArraySave) and "
        f"runs no handler, so one of your own would not be run; give Orbax's "
        f"{', '.join(HANDLER_ARGS)}, or leave the item out of item_handlers")


def read(item_handlers: Any, item_names: tuple[str, ...] | None
         ) -> tuple[Kinds | None, tuple[str, ...] | None]:
    """``item_handlers`` as (each item's handler kind, the manager's item names).

    A dict names items (added to ``item_names``, as Orbax's); one handler is the
    single-item manager's, and beside ``item_names`` a ConfigError (a ValueError,
    as Orbax refuses it)."""
    if item_handlers is None:
        return None, item_names
    if isinstance(item_handlers, dict):
        if not all(isinstance(k, str) and k for k in item_handlers):
            raise ConfigError(f"item_handlers' keys are item names, got "
                              f"{list(item_handlers)!r}")
        kinds: Kinds = {k: _kind(k, h) for k, h in item_handlers.items()}
        names = tuple(item_names or ()) + tuple(
            k for k in item_handlers if k not in (item_names or ()))
        return kinds, names
    if item_names:
        raise ConfigError("`item_handlers` in default item mode (one handler) and "
                          "`item_names` should not be provided together: give a dict of "
                          "handlers by item name, or no item_names")
    return {None: _kind(None, item_handlers)}, None


def check(kinds: Kinds | None, args: Any, call: str) -> None:
    """Refuse (ConfigError, a ValueError as Orbax's) ``args`` for an item whose
    handler takes other args; an item without a handler takes any mtc reads."""
    if not kinds or args is None or not is_orbax_args(args):
        return
    items = composite_items(args)
    pairs: list[tuple[str | None, Any]] = (
        [(k, args[k]) for k in items] if items is not None else [(None, args)])
    for item, a in pairs:
        if a is None or item not in kinds:
            continue
        takes = HANDLER_ARGS[kinds[item]]
        if type(a).__name__ not in takes:
            what = "the item" if item is None else f"Item {item!r}"
            raise ConfigError(
                f"{call}(): {what} and args {type(a).__name__} does not match with any "
                f"registered handler: item_handlers gives it {kinds[item]}, which takes "
                f"{takes[0].removesuffix('Args')} and {takes[1].removesuffix('Args')}")
