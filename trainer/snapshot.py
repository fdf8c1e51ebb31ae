"""The optional per-step in-memory snapshot: at most one step replayed on a resize."""

from __future__ import annotations

from typing import Any

import jax

from trainer.model import State, Trainer


def host_snapshot(state: State) -> dict[str, Any]:
    """A host-memory copy of the state (the values now; the next step donates the arrays)."""
    arrays = jax.device_get({"params": state["params"], "opt_state": state["opt_state"],
                             "rng": jax.random.key_data(state["rng"])})
    return {**arrays, "step": state["step"], "data": dict(state["data"])}


def from_snapshot(trainer: Trainer, snap: dict[str, Any]) -> State:
    sh = trainer.shardings
    arrays = jax.device_put({"params": snap["params"], "opt_state": snap["opt_state"]},
                            {"params": sh["params"], "opt_state": sh["opt_state"]})
    rng = jax.device_put(jax.random.wrap_key_data(snap["rng"]), sh["rng"])
    return {**arrays, "rng": rng, "step": snap["step"], "data": dict(snap["data"])}
