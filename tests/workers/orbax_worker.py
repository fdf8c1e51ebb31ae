"""One host of an UNMODIFIED Orbax multi-tier checkpointing job (CPU), for
``tests/test_orbax_compat.py``.

Orbax's own ``initialize_multi_tier_checkpointing`` and
``ReplicatorCheckpointManager`` talk to mtc's replicator through the files in
``--local-dir``; nothing of mtc is imported here.

argv: --local-dir DIR --phase {train,restart} --steps N --num-slices S
env:  MTC_ORBAX_NUM_PROCESSES: the job's process count. Orbax passes none to
      ``jax.distributed.initialize``; on GKE JAX's cluster detection supplies it,
      here a ``ClusterEnv`` subclass does.

train:   saves steps 1..N.
restart: restores ``latest_step()`` onto explicit shardings, then saves one more step.

Prints one line ``ORBAX_RESULT <json>`` with what it saw, including every
addressable shard restored (index and values) for the test to check.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

RESULT_PREFIX = "ORBAX_RESULT "
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[orbax-worker {time.monotonic() - T0:6.2f}s] {msg}", flush=True)


def value(step: int, rows: int, cols: int) -> Any:
    """The global ``w`` of ``step`` (the test recomputes it the same way)."""
    import numpy as np

    return np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) * 10.0 + step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local-dir", required=True)
    p.add_argument("--phase", choices=["train", "restart"], required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--num-slices", type=int, default=2)
    a = p.parse_args()

    # Orbax reads an absl flag during restore; a program not started through
    # absl.app.run must mark flags as parsed (keeps the defaults).
    from absl import flags

    flags.FLAGS.mark_as_parsed()

    import jax
    from jax._src import clusters

    class ProcessCountEnv(clusters.ClusterEnv):
        """Supplies only the process count; id and coordinator come from jax-init-info.txt."""

        name = "mtc_orbax_test"
        opt_in_only_method = False

        @classmethod
        def is_env_present(cls) -> bool:
            return "MTC_ORBAX_NUM_PROCESSES" in os.environ

        @classmethod
        def get_coordinator_address(cls, timeout_secs: int | None,
                                    override_coordinator_port: str | None) -> str:
            raise RuntimeError("the coordinator comes from jax-init-info.txt")

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ["MTC_ORBAX_NUM_PROCESSES"])

        @classmethod
        def get_process_id(cls) -> int:
            raise RuntimeError("the process id comes from jax-init-info.txt")

        @classmethod
        def get_local_process_id(cls) -> int | None:
            return None

    import numpy as np
    import orbax.checkpoint as ocp
    from etils import epath
    from orbax.checkpoint.experimental.emergency import replicator_checkpoint_manager as rcm
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import initialization

    local = epath.Path(a.local_dir)
    t = time.monotonic()
    initialization.initialize_multi_tier_checkpointing(
        local, num_slices=a.num_slices, backup_interval_minutes=30, run_name="mtcorbax",
        jax_initialization_timeout_seconds=60)
    visible = sorted(n for n in os.listdir(local) if not n.startswith("."))
    log(f"initialized in {time.monotonic() - t:.2f}s: process {jax.process_index()} of "
        f"{jax.process_count()}, local dir {visible}")

    devs = np.array(jax.devices()).reshape(a.num_slices, -1)  # a row per slice
    mesh = jax.sharding.Mesh(devs, ("replica", "model"))
    # Replicated across slices, sharded within a slice (data-parallel replicas).
    w_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
    s_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model"))
    rows, cols = 4, devs.shape[1] * 2

    def make_state(step: int) -> dict[str, Any]:
        w = value(step, rows, cols)
        s = np.full((devs.shape[1],), step, np.int32)
        return {"w": jax.make_array_from_callback(w.shape, w_sharding, lambda i: w[i]),
                "step": jax.make_array_from_callback(s.shape, s_sharding, lambda i: s[i])}

    mngr = rcm.ReplicatorCheckpointManager(
        local, rcm.ReplicatorCheckpointManagerOptions(save_interval_steps=1), global_mesh=mesh)
    result: dict[str, Any] = {
        "process": jax.process_index(), "phase": a.phase, "visible_at_start": visible,
        "steps_at_start": [int(s) for s in mngr.all_steps()],
        "latest_at_start": mngr.latest_step(), "rows": rows, "cols": cols}
    log(f"manager sees steps {result['steps_at_start']}")

    def save(step: int) -> None:
        t = time.monotonic()
        saved = mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(make_state(step))))
        mngr.wait_until_finished()
        if not saved:
            raise RuntimeError(f"step {step} was not saved")
        log(f"saved step {step} in {time.monotonic() - t:.2f}s")

    if a.phase == "train":
        for step in range(1, a.steps + 1):
            save(step)
    else:
        step = mngr.latest_step()
        if step is None:
            raise RuntimeError("nothing to restore")
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), make_state(0))
        t = time.monotonic()
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=abstract,
            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))))["state"]
        log(f"restored step {step} in {time.monotonic() - t:.2f}s")
        result["restored_step"] = int(step)
        result["shardings_ok"] = (restored["w"].sharding == w_sharding
                                  and restored["step"].sharding == s_sharding)
        result["shards"] = {
            k: [{"index": [list(sl.indices(n)[:2]) for sl, n in zip(sh.index, restored[k].shape,
                                                                     strict=True)],
                 "data": np.asarray(sh.data).tolist()}
                for sh in restored[k].addressable_shards]
            for k in ("w", "step")}
        save(step + 1)
    result["steps_at_end"] = [int(s) for s in mngr.all_steps()]
    mngr.close()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    log("done")


if __name__ == "__main__":
    main()
