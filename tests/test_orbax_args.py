"""mtc.orbax_args alone: which ``ocp.args`` requests mtc takes, the state or targets
each names, and the typed refusals (Orbax's own classes; no manager, no process)."""

from __future__ import annotations

import pickle
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mtc import orbax_args
from mtc.errors import ConfigError

STATE = {"w": np.arange(4.0), "step": 3}
# ids= wherever a Composite is a parameter: pytest reads its __name__, which a
# Composite answers with KeyError.


@pytest.mark.parametrize(("x", "want"), [
    (ocp.args.StandardSave(STATE), True),
    (ocp.args.Composite(state=ocp.args.StandardSave(STATE)), True),
    (ocp.args.StandardRestore(), True),
    (STATE, False),
    (None, False),
], ids=["save", "composite", "restore", "a pytree", "none"])
def test_is_orbax_args(x: Any, want: bool) -> None:
    assert orbax_args.is_orbax_args(x) is want


@pytest.mark.parametrize(("args", "state", "items"), [
    (ocp.args.StandardSave(STATE), STATE, None),
    (ocp.args.PyTreeSave(STATE), STATE, None),
    (ocp.args.JsonSave({"lr": 0.1}), {"lr": 0.1}, None),
    (ocp.args.Composite(state=ocp.args.StandardSave(STATE),
                        meta=ocp.args.JsonSave({"lr": 0.1})),
     {"state": STATE, "meta": {"lr": 0.1}}, ("state", "meta")),
], ids=["standard", "pytree", "json", "composite"])
def test_the_state_a_save_request_names(args: Any, state: Any,
                                        items: tuple[str, ...] | None) -> None:
    assert orbax_args.save_state(args) == state
    assert orbax_args.composite_items(args) == items


@pytest.mark.parametrize(("args", "match"), [
    (ocp.args.PyTreeSave(STATE, save_args={"w": ocp.SaveArgs()}), "save_args is not"),
    (ocp.args.StandardRestore(STATE), "cannot save StandardRestoreArgs"),
    (ocp.args.Composite(state=ocp.args.NumpyRandomKeySave(np.zeros(2))), "cannot save"),
], ids=["save_args", "a restore request", "a numpy random key item"])
def test_a_save_request_mtc_cannot_honour_is_refused(args: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        orbax_args.save_state(args)


def test_restore_targets() -> None:
    # Orbax's StandardRestore and PyTreeRestore name every leaf to restore (Whole),
    # unless PyTreeRestore(partial_restore=True).
    whole = orbax_args.Whole(STATE)
    assert orbax_args.restore_targets(ocp.args.StandardRestore(STATE)) == (None, whole)
    assert orbax_args.restore_targets(ocp.args.Composite(
        state=ocp.args.StandardRestore(STATE), meta=None)) == {"state": whole, "meta": None}
    assert orbax_args.restore_targets(ocp.args.PyTreeRestore(STATE)) == (None, whole)
    assert orbax_args.restore_targets(ocp.args.PyTreeRestore(
        STATE, partial_restore=True)) == (None, STATE)
    with pytest.raises(ConfigError, match="transforms is not supported"):
        orbax_args.restore_targets(ocp.args.PyTreeRestore(STATE, transforms={}))
    with pytest.raises(ConfigError, match="cannot restore StandardSaveArgs"):
        orbax_args.restore_targets(ocp.args.StandardSave(STATE))


def test_restore_args_describe_the_target() -> None:
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    ra = {"w": ocp.ArrayRestoreArgs(sharding=sharding, dtype=np.float32, global_shape=(4,)),
          "step": ocp.RestoreArgs()}
    got = orbax_args.restore_targets(ocp.args.PyTreeRestore(restore_args=ra))
    assert got == (None, {"w": jax.ShapeDtypeStruct((4,), np.float32, sharding=sharding),
                          "step": None})
    # What restore_args leave out comes from item=; with neither, a typed refusal.
    item = {"w": jax.ShapeDtypeStruct((4,), np.float64), "step": 3}
    no_dtype = {"w": ocp.ArrayRestoreArgs(sharding=sharding, global_shape=(4,)),
                "step": ocp.RestoreArgs()}
    assert orbax_args.restore_targets(ocp.args.PyTreeRestore(item, restore_args=no_dtype)) == (
        None, orbax_args.Whole({"w": jax.ShapeDtypeStruct((4,), np.float64, sharding=sharding),
                                "step": 3}))
    # An item of RestoreArgs leaves (PyTreeRestore(restore_args_tree) positionally):
    # Orbax reads it as the restore_args.
    assert orbax_args.restore_targets(ocp.args.PyTreeRestore(no_dtype)) == (
        None, {"w": orbax_args.OnSharding(sharding), "step": None})
    # Neither says the dtype: the checkpoint's, placed on the sharding given.
    assert orbax_args.restore_targets(ocp.args.PyTreeRestore(restore_args=no_dtype)) == (
        None, {"w": orbax_args.OnSharding(sharding), "step": None})
    with pytest.raises(ConfigError, match="gives no sharding"):
        orbax_args.restore_targets(ocp.args.PyTreeRestore(restore_args={
            "w": ocp.ArrayRestoreArgs(global_shape=(4,), dtype=np.float32)}))


@pytest.mark.parametrize(("names", "want"), [
    (None, None),
    (["state", "meta"], ("state", "meta")),
    (("state",), ("state",)),
    ("state", ConfigError),  # a string is not a list of names
    (["state", "state"], ConfigError),
    (["state", ""], ConfigError),
    ([1], ConfigError),
])
def test_check_item_names(names: Any, want: Any) -> None:
    if want is ConfigError:
        with pytest.raises(ConfigError, match="distinct item names"):
            orbax_args.check_item_names(names)
    else:
        assert orbax_args.check_item_names(names) == want


def test_the_restored_composite_is_the_requests_class() -> None:
    request = ocp.args.Composite(state=ocp.args.StandardRestore())
    got = orbax_args.composite_result(request, {"state": STATE})
    assert type(got) is type(request)
    assert got.state is STATE and got["state"] is STATE


def test_step_exists_is_orbax_step_already_exists_error_where_orbax_is_loaded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A switching user's ``except StepAlreadyExistsError`` catches mtc's refusal of
    a step that exists; without Orbax loaded it is mtc's StepExistsError alone."""
    from mtc.errors import FatalError, StepExistsError

    err = orbax_args.step_exists("step is already committed", step=4, host=1)
    assert isinstance(err, ocp.checkpoint_manager.StepAlreadyExistsError)
    assert isinstance(err, StepExistsError) and isinstance(err, FatalError)
    assert (err.step, err.host) == (4, 1) and "step 4, host 1" in str(err)
    assert type(err) is type(orbax_args.step_exists("again", step=5))  # one class
    with pytest.raises(ocp.checkpoint_manager.StepAlreadyExistsError):
        raise err
    again = pickle.loads(pickle.dumps(err))  # a user's multiprocessing pickles it
    assert type(again) is type(err) and (again.step, again.host) == (4, 1)
    assert str(again) == str(err)

    monkeypatch.delitem(__import__("sys").modules, "orbax.checkpoint.checkpoint_manager")
    plain = orbax_args.step_exists("step is already committed", step=4)
    assert type(plain) is StepExistsError and isinstance(plain, ValueError)


@pytest.mark.parametrize(("kwargs", "single"), [
    ({"restore_args": {"w": ocp.RestoreArgs()}}, True),
    ({"restore_args": None}, True),
    ({"params": {"restore_args": None}}, False),
    ({"params": {"restore_args": None}, "meta": {}}, False),
    ({}, False),
    (None, False),
], ids=["one item's", "one item's, none", "per item", "per item, two", "empty", "none"])
def test_legacy_restore_kwargs_of_one_item_or_per_item(kwargs: Any, single: bool) -> None:
    assert orbax_args.is_single_item_kwargs(kwargs) is single


def test_legacy_single_item_restore_kwargs_as_the_pytree_restore_they_mean() -> None:
    ra = {"w": ocp.RestoreArgs()}
    got = orbax_args.legacy_restore_one(None, {"restore_args": ra})
    assert isinstance(got, ocp.args.PyTreeRestore) and got.restore_args is ra
    assert got.item is None
    assert orbax_args.legacy_restore_one(None, {"restore_args": None}) is None  # as saved
    assert orbax_args.legacy_restore_one(STATE, {}).item is STATE
    with pytest.raises(ConfigError, match=r"restore_kwargs \['transforms'\] are not supported"):
        orbax_args.legacy_restore_one(None, {"restore_args": ra, "transforms": {}})
    with pytest.raises(ConfigError, match="restore_kwargs is Orbax's"):
        orbax_args.legacy_restore_one(None, [ra])
