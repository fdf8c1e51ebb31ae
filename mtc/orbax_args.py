"""Orbax habits: ``ocp.args`` objects given to ``save`` and ``restore``.

mtc accepts ``StandardSave``/``PyTreeSave``/``JsonSave`` and their restore
counterparts, alone or in a ``Composite``; each names a pytree that mtc saves
and restores as it does any state. Orbax is not imported: the classes are
recognised by name, so mtc works without it installed.
"""

from __future__ import annotations

from typing import Any

from mtc.errors import ConfigError

_SAVE = ("StandardSaveArgs", "PyTreeSaveArgs", "JsonSaveArgs")
_RESTORE = ("StandardRestoreArgs", "PyTreeRestoreArgs", "JsonRestoreArgs")
_ACCEPTED = ("ocp.args.StandardSave, PyTreeSave, JsonSave (restore: StandardRestore, "
             "PyTreeRestore, JsonRestore), or a Composite of them")


def is_orbax_args(x: Any) -> bool:
    return any(c.__name__ == "CheckpointArgs" and c.__module__.startswith("orbax.")
               for c in type(x).__mro__)


def _is_composite(x: Any) -> bool:
    return type(x).__name__ in ("CompositeArgs", "Composite")


def _refuse_options(a: Any, *fields: str) -> None:
    for f in fields:
        v = getattr(a, f, None)
        if (bool(v) if f == "partial_restore" else v is not None):
            raise ConfigError(f"{type(a).__name__}.{f} is not supported by mtc: every leaf is "
                              "saved as it is and restored into the target's shardings")


def _save_item(a: Any) -> Any:
    name = type(a).__name__
    if name not in _SAVE:
        raise ConfigError(f"mtc cannot save {name}; it accepts {_ACCEPTED}")
    _refuse_options(a, "save_args")
    return a.item


def _restore_item(a: Any) -> Any:
    name = type(a).__name__
    if name not in _RESTORE:
        raise ConfigError(f"mtc cannot restore {name}; it accepts {_ACCEPTED}")
    if getattr(a, "restore_args", None) is not None:
        raise ConfigError(f"{name}.restore_args is not supported by mtc: pass item= a tree of "
                          "jax.ShapeDtypeStruct with .sharding (or arrays) instead")
    _refuse_options(a, "transforms", "legacy_transform_fn", "partial_restore")
    return getattr(a, "item", None)


def save_state(args: Any) -> Any:
    """The pytree an ``ocp.args`` save request names (a dict for a Composite)."""
    if _is_composite(args):
        return {k: _save_item(args[k]) for k in args.keys()}
    return _save_item(args)


def restore_targets(args: Any) -> dict[str, Any] | tuple[None, Any]:
    """A Composite: item name -> target (None: as saved); else (None, target)."""
    if _is_composite(args):
        return {k: _restore_item(args[k]) for k in args.keys()}
    return (None, _restore_item(args))


def positional_hint(call: str) -> str:
    return (f"{call} got an Orbax ocp.args object as the state; pass it as args=..., "
            f"e.g. mgr.{call}(step, args=ocp.args.StandardSave(state)), or pass the "
            "pytree itself")
