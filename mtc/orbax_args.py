"""Orbax habits: ``ocp.args`` objects given to ``save`` and ``restore``.

mtc accepts ``StandardSave``/``PyTreeSave``/``JsonSave`` and their restore
counterparts, alone or in a ``Composite``; each names a pytree that mtc saves
and restores as it does any state. Orbax is not imported: the classes are
recognised by name, so mtc works without it installed.
"""

from __future__ import annotations

import sys
from typing import Any

from mtc.errors import ConfigError, StepExistsError

_SAVE = ("StandardSaveArgs", "PyTreeSaveArgs", "JsonSaveArgs", "ArraySaveArgs")
# ``ocp.args.ArrayRestore``'s class is named as the per-leaf ``ocp.ArrayRestoreArgs``
# too: told apart by being Orbax's ``CheckpointArgs`` (:func:`is_orbax_args`).
_RESTORE = ("StandardRestoreArgs", "PyTreeRestoreArgs", "JsonRestoreArgs", "ArrayRestoreArgs")
_ACCEPTED = ("ocp.args.StandardSave, PyTreeSave, JsonSave, ArraySave (restore: "
             "StandardRestore, PyTreeRestore, JsonRestore, ArrayRestore), or a Composite "
             "of them")


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
    if a is None:  # Composite(state=None): the item as saved
        return None
    name = type(a).__name__
    if name not in _RESTORE or not is_orbax_args(a):
        raise ConfigError(f"mtc cannot restore {name}; it accepts {_ACCEPTED}")
    _refuse_options(a, "transforms", "legacy_transform_fn")
    item = getattr(a, "item", None)
    restore_args = getattr(a, "restore_args", None)
    if restore_args is None and item is not None and _all_restore_args(item):
        # PyTreeRestore(restore_args_tree) positionally: Orbax reads an item whose
        # leaves are all RestoreArgs as the restore_args (the checkpoint's shapes).
        item, restore_args = None, item
    target = item if restore_args is None else with_restore_args(name, item, restore_args)
    if item is not None and name in _WHOLE and not getattr(a, "partial_restore", False):
        return Whole(target)
    return target


# Orbax's args whose item must name every leaf saved (partial_restore=False, the
# default; StandardRestore has no partial restore): a leaf left out is a ValueError.
_WHOLE = ("StandardRestoreArgs", "PyTreeRestoreArgs")


class Whole:
    """A restore target that must name every leaf saved under it (a placeholder
    ``...`` names one), as Orbax's ``PyTreeRestore`` without ``partial_restore=True``
    and ``StandardRestore`` want: a leaf the target leaves out raises
    :class:`~mtc.errors.TargetMismatchError` (a ``ValueError``) instead of being
    silently not restored. mtc's own ``restore(step, target)`` restores the part a
    target names."""

    __slots__ = ("item",)

    def __init__(self, item: Any) -> None:
        self.item = item

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Whole) and other.item == self.item

    __hash__ = None  # type: ignore[assignment]  # as the item it holds: not hashable

    def __repr__(self) -> str:
        return f"Whole({self.item!r})"


def _all_restore_args(tree: Any) -> bool:
    import jax

    leaves = jax.tree_util.tree_leaves(tree, is_leaf=_is_restore_args)
    return bool(leaves) and all(_is_restore_args(x) for x in leaves)


def _is_restore_args(x: Any) -> bool:
    return type(x).__name__ in ("ArrayRestoreArgs", "RestoreArgs")


def is_placeholder(x: Any) -> bool:
    """Orbax's ``PLACEHOLDER`` (``...``): a leaf of the target left out of the restore
    and given back as it is."""
    return x is Ellipsis


class OnSharding:
    """A restore target leaf whose shape (and dtype, unless ``dtype``) are the
    checkpoint's, placed on ``sharding``: Orbax's ``ArrayRestoreArgs(sharding=...)``
    without ``global_shape``, read as Orbax reads it (the manifest has the rest)."""

    __slots__ = ("dtype", "sharding")

    def __init__(self, sharding: Any, dtype: Any = None) -> None:
        self.sharding = sharding
        self.dtype = dtype

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, OnSharding) and other.sharding == self.sharding
                and other.dtype == self.dtype)

    def __hash__(self) -> int:
        return hash((self.sharding, self.dtype))

    def __repr__(self) -> str:
        return f"OnSharding({self.sharding!r}, dtype={self.dtype!r})"


def with_restore_args(name: str, item: Any, restore_args: Any) -> Any:
    """The target Orbax's ``restore_args`` (``ArrayRestoreArgs(sharding=, dtype=,
    global_shape=)`` per leaf, as ``ocp.checkpoint_utils.construct_restore_args``
    makes them) describe, over ``item`` when given: a ``jax.ShapeDtypeStruct``
    per array leaf with the shape, dtype (a cast) and sharding they state; where
    they and ``item`` state no shape or dtype, an :class:`OnSharding` (the
    checkpoint's). ``item``'s placeholders (``...``) stay; ``restore_args`` may
    cover more of the tree than ``item`` (Orbax's ``partial_restore``): only
    ``item``'s leaves are restored."""
    import jax

    def leaf(ra: Any, t: Any = None) -> Any:
        if is_placeholder(t) or not _is_restore_args(ra):
            return ra if t is None else t
        if type(ra).__name__ == "RestoreArgs":  # a plain value: as saved (or item's)
            return t
        sharding = ra.sharding
        if sharding is None and ra.mesh is not None and ra.mesh_axes is not None:
            sharding = jax.sharding.NamedSharding(ra.mesh, ra.mesh_axes)
        sharding = sharding if sharding is not None else getattr(t, "sharding", None)
        shape = ra.global_shape if ra.global_shape is not None else getattr(t, "shape", None)
        dtype = ra.dtype if ra.dtype is not None else getattr(t, "dtype", None)
        if sharding is None:
            raise ConfigError(
                f"{name}.restore_args: a leaf's ArrayRestoreArgs gives no sharding and item= "
                "has none either; pass sharding= (where the array goes), or item= (the "
                "abstract state)")
        if shape is None or dtype is None:
            return OnSharding(sharding, dtype)
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)

    if item is None:
        return jax.tree_util.tree_map(leaf, restore_args, is_leaf=_is_restore_args)
    from mtc import treepath

    by_path = {treepath.path_str(p): ra for p, ra in jax.tree_util.tree_flatten_with_path(
        restore_args, is_leaf=_is_restore_args)[0]}
    flat, treedef = treepath.flatten(item)
    return jax.tree_util.tree_unflatten(treedef, [
        leaf(by_path[treepath.path_str(p)], t) if treepath.path_str(p) in by_path else t
        for p, t in flat])


def save_state(args: Any) -> Any:
    """The pytree an ``ocp.args`` save request names (a dict for a Composite)."""
    if _is_composite(args):
        return {k: _save_item(args[k]) for k in args.keys()}
    return _save_item(args)


def composite_items(args: Any) -> tuple[str, ...] | None:
    """The item names of an ``ocp.args`` save request that is a Composite, else None."""
    return tuple(str(k) for k in args.keys()) if _is_composite(args) else None


def check_item_names(names: Any) -> tuple[str, ...] | None:
    """Orbax's ``item_names``: distinct non-empty strings (None: not given)."""
    if names is None:
        return None
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names) \
            or len(set(names)) != len(list(names)):
        raise ConfigError(f"item_names are distinct item names, got {names!r}")
    return tuple(names)


def composite_result(args: Any, items: dict[str, Any]) -> Any:
    """The restored items as Orbax returns them: the ``Composite`` class the request
    came in (attribute and item access: ``restored.state``, ``restored["state"]``)."""
    return type(args)(**items)


def composite_of(items: dict[str, Any], *, metadata: bool = False) -> Any:
    """``items`` as an Orbax ``Composite`` (for a manager given ``item_names``, or a
    step saved as one: its user has Orbax); a dict where Orbax is not installed.
    ``metadata``: the plain ``Composite`` Orbax's ``item_metadata`` answers (the
    base class of ``ocp.args.Composite``, found by name: its module is private)."""
    try:
        from orbax.checkpoint import args as ocp_args
    except ImportError:
        return items
    cls = ocp_args.Composite
    if metadata:
        cls = next((c for c in cls.__mro__[1:] if c.__name__ == "Composite"), cls)
    return cls(**items)


def restore_targets(args: Any) -> dict[str, Any] | tuple[None, Any]:
    """A Composite: item name -> target (None: as saved); else (None, target)."""
    if _is_composite(args):
        return {k: _restore_item(args[k]) for k in args.keys()}
    return (None, _restore_item(args))


def positional_hint(call: str) -> str:
    return (f"{call} got an Orbax ocp.args object as the state; pass it as args=..., "
            f"e.g. mgr.{call}(step, args=ocp.args.StandardSave(state)), or pass the "
            "pytree itself")


def root_metadata(custom: Any) -> Any:
    """Orbax's ``metadata()`` answer: its ``RootMetadata`` (``custom_metadata``) where
    Orbax is installed, else a dict of the same field."""
    try:
        from orbax.checkpoint import metadata as ocp_metadata
    except ImportError:
        return {"custom_metadata": custom}
    return ocp_metadata.RootMetadata(custom_metadata=custom)


def step_metadata(item_metadata: Any, metrics: Any, custom: Any) -> Any:
    """Orbax's ``metadata(step)`` answer: its ``StepMetadata`` (the fields mtc keeps:
    ``item_metadata``, ``metrics``, ``custom_metadata``) where Orbax is installed,
    else a dict of them."""
    try:
        from orbax.checkpoint import metadata as ocp_metadata
    except ImportError:
        return {"item_metadata": item_metadata, "metrics": metrics, "custom_metadata": custom}
    return ocp_metadata.StepMetadata(item_metadata=item_metadata, metrics=metrics,
                                     custom_metadata=custom)


# The keys of Orbax's per-item legacy restore kwargs.
_ITEM_KWARGS = frozenset({"restore_args", "transforms", "transforms_default_to_original",
                          "legacy_transform_fn", "partial_restore"})


def is_single_item_kwargs(restore_kwargs: Any) -> bool:
    """Whether legacy ``restore_kwargs`` are one item's (``{"restore_args": tree}``, a
    single-item manager's form) rather than ``{item: {"restore_args": ...}}``."""
    return (isinstance(restore_kwargs, dict) and bool(restore_kwargs)
            and set(restore_kwargs) <= _ITEM_KWARGS)


def legacy_restore_one(item: Any, restore_kwargs: Any) -> Any:
    """Orbax's legacy single-item ``restore(step, item, restore_kwargs={"restore_args":
    ...})`` as the ``PyTreeRestore`` it means (None: as saved)."""
    if not isinstance(restore_kwargs, dict):
        raise ConfigError("restore_kwargs is Orbax's {'restore_args': ...} (one item) or "
                          f"{{item: {{'restore_args': ...}}}}, got {type(restore_kwargs).__name__}")
    other = sorted(set(restore_kwargs) - {"restore_args"})
    if other:
        raise ConfigError(f"restore_kwargs {other} are not supported by mtc: every leaf is "
                          "restored into the target's shardings (give restore_args or a target)")
    ra = restore_kwargs.get("restore_args")
    if item is None and ra is None:
        return None
    from orbax.checkpoint import args as ocp_args  # its user has Orbax: its legacy form

    return ocp_args.PyTreeRestore(item=item, restore_args=ra)


def legacy_restore(items: Any, restore_kwargs: Any) -> Any:
    """Orbax's legacy ``restore(step, items, restore_kwargs={item: {"restore_args":
    ...}})`` as the ``Composite`` of ``PyTreeRestore`` it means (an item without a
    target or restore_args: as saved)."""
    if not isinstance(restore_kwargs, dict) or not all(
            isinstance(v, dict) for v in restore_kwargs.values()):
        raise ConfigError("restore_kwargs is Orbax's {item: {'restore_args': ...}}, got "
                          f"{type(restore_kwargs).__name__}")
    if items is not None and not isinstance(items, dict):
        raise ConfigError("with restore_kwargs, the target is a dict of items")
    from orbax.checkpoint import args as ocp_args  # its user has Orbax: its legacy form

    names = list(items or {}) + [k for k in restore_kwargs if k not in (items or {})]
    out: dict[str, Any] = {}
    for name in names:
        item = (items or {}).get(name)
        ra = restore_kwargs.get(name, {}).get("restore_args")
        out[name] = (None if item is None and ra is None
                     else ocp_args.PyTreeRestore(item=item, restore_args=ra))
    return ocp_args.Composite(**out)


# Orbax's ``StepAlreadyExistsError`` class -> mtc's StepExistsError made also one of it.
_ORBAX_STEP_EXISTS: dict[type, type] = {}


def step_exists(message: str, *, step: int, host: int | None = None) -> StepExistsError:
    """A :class:`StepExistsError`, which is also Orbax's own
    ``checkpoint_manager.StepAlreadyExistsError`` where the process has Orbax loaded:
    a switching user's ``except StepAlreadyExistsError`` clause still catches what
    Orbax raised in the same place. Orbax is never imported for this (a user who
    names its class has imported it; one who has not needs only the ``ValueError``)."""
    module = sys.modules.get("orbax.checkpoint.checkpoint_manager")
    orbax_cls = getattr(module, "StepAlreadyExistsError", None)
    if not (isinstance(orbax_cls, type) and issubclass(orbax_cls, ValueError)):
        return StepExistsError(message, step=step, host=host)
    cls = _ORBAX_STEP_EXISTS.get(orbax_cls)
    if cls is None:
        cls = type("StepExistsError", (StepExistsError, orbax_cls),
                   {"__module__": StepExistsError.__module__,
                    "__qualname__": StepExistsError.__qualname__,
                    "__doc__": StepExistsError.__doc__,
                    # Pickled (a user's multiprocessing), it is made again by name.
                    "__reduce__": lambda e: (_step_exists_again, (e.message, e.step, e.host))})
        _ORBAX_STEP_EXISTS[orbax_cls] = cls
    err = cls(message, step=step, host=host)
    assert isinstance(err, StepExistsError)
    return err


def _step_exists_again(message: str, step: int, host: int | None) -> StepExistsError:
    return step_exists(message, step=step, host=host)
