"""An Orbax training loop switched to mtc by changing the import and the constructor.

The loop below is written against Orbax's ``CheckpointManager`` as Orbax's docs show
it: a ``Composite`` of a ``StandardSave`` (sharded arrays of several dtypes and a
Python scalar) and a ``JsonSave``, ``metrics`` with every save, ``best_fn`` and
``best_mode``, ``keep_period``, ``max_to_keep`` and ``save_interval_steps``, then
``best_step``/``latest_step``/``all_steps``/``metrics`` and Composite restores of
the latest and the best step. It runs once on Orbax's own manager and once on
mtc's, in this test, and every answer and every restored value and type must be
the same. Real Orbax, real mtc (4 simulated hosts on 8 CPU devices).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc

OPTIONS = dict(save_interval_steps=2, max_to_keep=3, keep_period=8,
               best_fn=lambda m: m["loss"], best_mode="min")


def make_state(mesh: Mesh, step: int) -> dict[str, Any]:
    """A training state at ``step``: f32 and bf16 weights sharded two ways, an int32
    counter replicated, and the step as a Python int."""
    w = jnp.arange(128.0, dtype=jnp.float32).reshape(16, 8) * (step + 1)
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("model", None))),
            "b": jax.device_put(jnp.linspace(0, step, 8, dtype=jnp.bfloat16),
                                NamedSharding(mesh, P("model"))),
        },
        "opt": {"count": jax.device_put(jnp.full((4,), step, jnp.int32),
                                        NamedSharding(mesh, P()))},
        "step": step,
    }


def loss_at(step: int) -> float:
    return round(abs(step - 10) / 10 + 0.125 * (step % 3), 3)  # best: step 10


def orbax_style_loop(mngr: Any, mesh: Mesh) -> dict[str, Any]:
    """What an Orbax user wrote; the manager is Orbax's or mtc's."""
    for step in range(1, 21):
        state = make_state(mesh, step)
        mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave({"seen": step * 64, "lr": 0.1 / step, "tag": f"s{step}"})),
            metrics={"loss": loss_at(step)})
    mngr.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, make_state(mesh, 0))
    out: dict[str, Any] = {"all_steps": list(mngr.all_steps()),
                           "latest": mngr.latest_step(), "best": mngr.best_step()}
    out["metrics"] = {s: mngr.metrics(s) for s in out["all_steps"]}
    for which in ("latest", "best"):
        out[which + "_restored"] = mngr.restore(out[which], args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
    return out


def compare(want: Any, got: Any, where: str = "") -> None:
    """Same type, and for arrays the same dtype, shape, sharding and values."""
    assert type(got) is type(want), f"{where}: {type(got).__name__}, Orbax {type(want).__name__}"
    if isinstance(want, dict) or type(want).__name__ == "CompositeArgs":
        assert sorted(got.keys()) == sorted(want.keys()), where
        for k in want.keys():
            compare(want[k], got[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            compare(w, g, f"{where}[{i}]")
    elif isinstance(want, jax.Array):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), where
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=where)
    else:
        assert got == want, f"{where}: {got!r}, Orbax {want!r}"


@pytest.mark.parametrize("managers", ["orbax-then-mtc"])
def test_an_orbax_loop_gives_the_same_results_on_mtc(managers: str, ramdisk: Path,
                                                     tmp_path: Path, mesh: Mesh) -> None:
    make: dict[str, Callable[[], Any]] = {
        # The only lines that differ: the import and the constructor.
        "orbax": lambda: ocp.CheckpointManager(
            tmp_path / "orbax", options=ocp.CheckpointManagerOptions(**OPTIONS)),
        "mtc": lambda: mtc.CheckpointManager(
            ramdisk, mesh=mesh, options=mtc.Options(**OPTIONS, simulated_hosts=4)),
    }
    results = {}
    for name in managers.split("-then-"):
        with make[name]() as mngr:
            results[name] = orbax_style_loop(mngr, mesh)
    want, got = results["orbax"], results["mtc"]
    # Orbax's rules chose the same steps: 1 (the first save), the interval, best_fn
    # with max_to_keep, keep_period.
    assert got["all_steps"] == want["all_steps"], (got["all_steps"], want["all_steps"])
    assert len(want["all_steps"]) > 3  # keep_period kept some beyond max_to_keep
    assert (got["latest"], got["best"]) == (want["latest"], want["best"])
    assert got["latest"] != got["best"]
    compare(want["metrics"], got["metrics"], "metrics")
    for which in ("latest_restored", "best_restored"):
        compare(want[which], got[which], which)
        assert got[which].state is got[which]["state"]  # attribute and item access
