"""Controller side of a restore: match the target, plan, fetch, and load.

Array leaves are planned onto the target shardings and read by the host-side
loader; PRNG keys are rebuilt from their key data; numpy and plain values come
back as saved. Leaves are matched by key path, so a target may name a subset
of the saved tree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mtc import orbax_args, treepath
from mtc.contract import LeafSpec, Piece, ReadTask
from mtc.dispatch import Dispatch
from mtc.errors import ManifestError, TargetMismatchError
from mtc.manifest import Index, LeafEntry
from mtc.restore.plan import Planner, SavedStep, check_leaf
from mtc.shards import is_single_device_sharding, paste
from mtc.topology import Topology


def _key_data_sharding(target: Any, extra: int) -> jax.sharding.Sharding:
    if isinstance(target, jax.Array):
        return jax.random.key_data(target).sharding
    s = target.sharding
    if isinstance(s, NamedSharding):
        return NamedSharding(s.mesh, PartitionSpec(*s.spec, *([None] * extra)))
    if is_single_device_sharding(s):
        return s
    raise TargetMismatchError(f"PRNG key targets need a NamedSharding, got {type(s).__name__}")


def _target_sharding(target: Any) -> jax.sharding.Sharding | None:
    if isinstance(target, jax.Array):
        return target.sharding
    if isinstance(target, jax.ShapeDtypeStruct):
        return target.sharding
    return None


def _full(shape: tuple[int, ...]) -> Index:
    return tuple((0, d) for d in shape)


def _assemble(dispatch: Dispatch, step: int, leaf_no: int, leaf: LeafEntry, index: Index,
              pieces: tuple[Piece, ...]) -> np.ndarray:
    """The ``index`` region of a leaf, from pieces that may sit on several hosts."""
    hosts = {p.host for p in pieces}
    if len(hosts) == 1:  # the usual case (numpy leaves are on every host): one read
        task = ReadTask(leaf_no, index, leaf.dtype, (), pieces)
        region = dispatch.read(step, hosts.pop(), [task])[0]
        # The caller's numpy leaf must be its own, writable memory: copy only a
        # view of something shared (a sidecar's reply mapping).
        return region if region.flags.writeable else np.array(region)
    out = np.empty(tuple(b - a for a, b in index), dtype=jax.numpy.dtype(leaf.dtype))
    for h in sorted(hosts):
        mine = [p for p in pieces if p.host == h]
        got = dispatch.read(step, h, [ReadTask(leaf_no, p.entry.index, leaf.dtype, (), (p,))
                                      for p in mine])
        for p, region in zip(mine, got, strict=True):
            paste(out, index, region, p.entry.index)
    return out


def _is_metric(leaf: LeafEntry) -> bool:
    return leaf.path.startswith(treepath.METRICS_ROOT)


def saved_items(saved: SavedStep) -> list[str] | None:
    """The item names of a step saved as an Orbax ``Composite``, else None."""
    for leaf in saved.leaves:
        if leaf.path == treepath.ITEMS_ROOT and leaf.kind == "value":
            try:
                names = json.loads(treepath.decode_value(leaf.value))
            except (TypeError, ValueError, KeyError):
                return None  # not a list of names: a plain restore, as before
            return [str(n) for n in names] if isinstance(names, list) else None
    return None


def custom_of(saved: SavedStep) -> Any:
    """Orbax's ``custom_metadata`` saved with the step ({} when none was)."""
    for leaf in saved.leaves:
        if leaf.path == treepath.CUSTOM_ROOT and leaf.kind == "value":
            try:
                return json.loads(treepath.decode_value(leaf.value))
            except (TypeError, ValueError):
                return {}
    return {}


def saved_at_of(saved: SavedStep) -> float | None:
    """When the step's save began (seconds since the epoch), or None (a step saved
    by an mtc that did not keep it)."""
    for leaf in saved.leaves:
        if leaf.path == treepath.SAVED_AT_ROOT and leaf.kind == "value":
            try:
                t = treepath.decode_value(leaf.value)
            except (TypeError, ValueError, ManifestError):
                return None
            return float(t) if isinstance(t, float) else None
    return None


def metrics_of(saved: SavedStep) -> Any:
    """The ``metrics`` saved with the step, or None."""
    items = [(leaf.keys, treepath.decode_value(leaf.value))
             for leaf in saved.leaves if _is_metric(leaf)]
    return treepath.unflatten_from_keys(items)[treepath.METRICS_ROOT] if items else None


def saved_sharding(leaf: LeafEntry, mesh: jax.sharding.Mesh) -> jax.sharding.Sharding:
    """Where an array restored without a target goes: the sharding it was saved with
    where its devices exist (as Orbax's: a large model comes back as laid out, not
    replicated); else on ``mesh``, the partition spec it was saved with when
    ``mesh`` has those axes, of the sizes saved, and they divide the array; else
    replicated over ``mesh``."""
    s = leaf.sharding or {}
    same = _as_saved_sharding(s)
    if same is not None:
        return same
    if s.get("type") == "named":
        sizes = dict(zip(s.get("axes", ()), s.get("mesh_shape", ()), strict=False))
        spec = [tuple(p) if isinstance(p, list) else p for p in s.get("spec", ())]
        ok = len(spec) <= len(leaf.shape)
        for dim, p in zip(leaf.shape, spec, strict=False):
            names = () if p is None else p if isinstance(p, tuple) else (p,)
            if any(mesh.shape.get(n) != sizes.get(n) for n in names):
                ok = False
                break
            parts = int(np.prod([mesh.shape[n] for n in names])) if names else 1
            ok = ok and dim % parts == 0
        if ok:
            return NamedSharding(mesh, PartitionSpec(*spec))
    return NamedSharding(mesh, PartitionSpec())


def _as_saved_sharding(s: dict[str, Any]) -> jax.sharding.Sharding | None:
    """The sharding a manifest describes (:func:`mtc.save.stage.describe_sharding`),
    when every device it names exists here; None otherwise."""
    ids = s.get("device_ids")
    if not isinstance(ids, list) or not ids:
        return None
    devices = {d.id: d for d in jax.devices()}
    if not all(isinstance(i, int) and i in devices for i in ids):
        return None
    if s.get("type") == "single" and len(ids) == 1:
        return jax.sharding.SingleDeviceSharding(devices[ids[0]])
    if s.get("type") != "named":
        return None
    shape, axes = s.get("mesh_shape"), s.get("axes")
    if not isinstance(shape, list) or not isinstance(axes, list) or len(shape) != len(axes) \
            or int(np.prod(shape)) != len(ids) or len(set(ids)) != len(ids):
        return None
    spec = [tuple(p) if isinstance(p, list) else p for p in s.get("spec", ())]
    try:
        mesh = jax.sharding.Mesh(np.array([devices[i] for i in ids]).reshape(shape), tuple(axes))
        return NamedSharding(mesh, PartitionSpec(*spec))
    except (TypeError, ValueError):
        return None  # a description this JAX cannot rebuild: placed on the manager's mesh


def restore_tree(saved: SavedStep, target: Any, topology: Topology, dispatch: Dispatch,
                 *, prefix: tuple[str, Any] | None = None,
                 mesh: jax.sharding.Mesh | None = None,
                 name_all: bool | tuple[str, Any] = False) -> Any:
    """The step's leaves matched to ``target`` (or, without one, all of them, or
    those under the top-level key ``prefix``, as nested dicts and lists). Without
    a target and with ``mesh``, arrays come back as Orbax gives them: sharded
    ``jax.Array``s on ``mesh`` (:func:`saved_sharding`), dict keys as strings;
    without ``mesh``, as numpy arrays with the key types saved. ``name_all``: the
    target must name every leaf saved (``True``) or saved under that top-level key
    (Orbax's args without ``partial_restore``: :class:`mtc.orbax_args.Whole`)."""
    step = saved.step
    leaves = saved.leaves
    by_path = {leaf.path: i for i, leaf in enumerate(leaves)}
    planner = Planner(saved, topology)
    reader = topology.local_hosts[0]

    if target is None:
        wanted: list[tuple[int, Any]] = [
            (i, None if mesh is None or leaf.kind != "array" else jax.ShapeDtypeStruct(
                leaf.shape, jax.numpy.dtype(leaf.dtype), sharding=saved_sharding(leaf, mesh)))
            for i, leaf in enumerate(leaves)
            if not treepath.is_own_leaf(leaf.path) and (prefix is None or (
                leaf.keys and tuple(leaf.keys[0]) == prefix))]
        flat_target = None
        treedef = None
    else:
        flat_target, treedef = treepath.flatten(target)
        _check_placeholders(step, flat_target, by_path)
        if name_all:
            _check_names_all(step, leaves, flat_target, name_all)
        # Placeholders (Orbax's ``...``) are left out and given back as they are.
        flat_target = [(p, t) for p, t in flat_target if not orbax_args.is_placeholder(t)]
        missing = [treepath.path_str(p) for p, _ in flat_target
                   if treepath.path_str(p) not in by_path]
        if missing:
            raise TargetMismatchError(f"target leaves not in the checkpoint: {missing}",
                                      step=step)
        wanted = [(by_path[treepath.path_str(p)], _as_saved(leaves[by_path[
            treepath.path_str(p)]], t)) for p, t in flat_target]

    results: dict[int, Any] = {}
    tasks: list[ReadTask] = []
    specs: dict[int, LeafSpec] = {}
    host_side: list[tuple[int, LeafEntry]] = []
    for i, t in wanted:
        leaf = leaves[i]
        if leaf.kind == "value":
            if isinstance(t, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)):
                raise TargetMismatchError(f"{leaf.path} was saved as a plain value, "
                                          f"target is an array", step=step)
            results[i] = treepath.decode_value(leaf.value)
            continue
        sharding = _target_sharding(t) if t is not None else None
        if sharding is None and isinstance(t, jax.ShapeDtypeStruct) and leaf.kind != "numpy":
            # Coming back as numpy would silently change the leaf's type.
            raise TargetMismatchError(
                f"target {leaf.path} is a jax.ShapeDtypeStruct without .sharding; give it "
                "sharding= (where the array goes), or use a numpy array or None as the "
                "target to get numpy", step=step)
        if sharding is None:
            if t is not None and hasattr(t, "shape"):
                check_leaf(step, leaf, t)
            host_side.append((i, leaf))
            continue
        shape, dtype = check_leaf(step, leaf, t)
        if leaf.kind == "prng_key":
            sharding = _key_data_sharding(t, len(shape) - len(t.shape))
        specs[i] = LeafSpec(shape, dtype, sharding)
        for host, host_tasks in planner.tasks_for(i, leaf, sharding, shape).items():
            if host in topology.local_hosts or topology.num_hosts == 1:
                tasks.extend(host_tasks)

    # Leaves without a target sharding are assembled whole in the controller's
    # memory, each piece read (and verified) by the host holding it.
    for i, leaf in host_side:
        whole = _full(leaf.shape)
        pieces = planner.tasks_for_region(i, leaf, whole, reader)
        whole_arr = _assemble(dispatch, step, i, leaf, whole, pieces)
        results[i] = (jax.random.wrap_key_data(jax.numpy.asarray(whole_arr), impl=leaf.key_impl)
                      if leaf.kind == "prng_key" else whole_arr)

    if specs:
        loaded = dispatch.load(step, tasks, specs)
        for i, arr in loaded.items():
            leaf = leaves[i]
            results[i] = (jax.random.wrap_key_data(arr, impl=leaf.key_impl)
                          if leaf.kind == "prng_key" else arr)

    for i, t in wanted:  # a target of another dtype of the same kind: cast, as Orbax's
        want = getattr(t, "dtype", None)
        if want is not None and leaves[i].kind in ("array", "numpy") \
                and jax.numpy.dtype(want) != jax.numpy.dtype(leaves[i].dtype):
            results[i] = results[i].astype(want)
    if flat_target is None:
        return treepath.unflatten_from_keys([(leaves[i].keys, results[i]) for i, _ in wanted],
                                            str_keys=mesh is not None)
    out = iter([results[i] for i, _ in wanted])
    return jax.tree_util.tree_unflatten(treedef, [
        t if orbax_args.is_placeholder(t) else next(out) for _, t in treepath.flatten(target)[0]])


def _as_saved(leaf: LeafEntry, t: Any) -> Any:
    """An :class:`~mtc.orbax_args.OnSharding` target as the array the checkpoint holds
    (its shape; its dtype unless one was given), on the sharding given."""
    if not isinstance(t, orbax_args.OnSharding):
        return t
    if leaf.kind == "value":
        return None  # a plain value: as saved, as Orbax's restore_args leave it
    dtype = t.dtype if t.dtype is not None else jax.numpy.dtype(leaf.dtype)
    return jax.ShapeDtypeStruct(tuple(leaf.shape), dtype, sharding=t.sharding)


def _check_names_all(step: int, leaves: Sequence[LeafEntry], flat: list[tuple[Any, Any]],
                     name_all: bool | tuple[str, Any]) -> None:
    """Every saved leaf in scope is named by the target (a placeholder names one), as
    Orbax's args without ``partial_restore`` want: a leaf left out would otherwise be
    silently not restored (a typo in a key drops it from the state)."""
    named = {treepath.path_str(p) for p, _ in flat}
    left_out = [leaf.path for leaf in leaves if not treepath.is_own_leaf(leaf.path)
                and (name_all is True or (leaf.keys and tuple(leaf.keys[0]) == name_all))
                and leaf.path not in named]
    if left_out:
        raise TargetMismatchError(
            f"User-provided restore item and on-disk value metadata tree structures do not "
            f"match: {len(left_out)} saved leaves are not in the target "
            f"({', '.join(left_out[:5])}{', ...' if len(left_out) > 5 else ''}). If this "
            f"mismatch is intentional, pass `partial_restore=True` (PyTreeRestore) to only "
            f"restore parameters found in `item`, or give those leaves as placeholders (...)",
            step=step)


def _check_placeholders(step: int, flat: list[tuple[Any, Any]], by_path: dict[str, int]) -> None:
    """A placeholder stands for one saved leaf, as Orbax's: one standing for a subtree
    is refused (a typo in a partial restore would otherwise drop a whole subtree)."""
    for p, t in flat:
        where = treepath.path_str(p)
        if orbax_args.is_placeholder(t) and where not in by_path:
            kind = ("a subtree" if any(k.startswith(where + "[") or k.startswith(where + ".")
                                       for k in by_path) else "nothing saved")
            raise TargetMismatchError(f"User-provided restore item and on-disk value differ: "
                                      f"the placeholder at {where} stands for {kind}, and a "
                                      "placeholder (...) stands for one saved leaf", step=step)
