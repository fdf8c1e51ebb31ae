"""``mtc-train-k8s``: the demo trainer as a cluster job, on Pathways or multi-controller JAX.

The same LM as ``mtc.trainer.train``, checkpointed with mtc to each host's RAM
disk (``--ramdisk``, the path mounted on every worker), with the replicators of
``deploy/`` copying steps to peers. On start it restores the newest step every
host can restore (the replicators agree on it and fetch what a replaced host
lacks from its peers), or initializes from ``--seed``.

- ``--mode pathways`` (auto when ``JAX_PLATFORMS=proxy``): the single controller
  in the ``pathways-head`` pod; ``pathwaysutils.initialize()`` connects to the
  proxy. Host-side code runs in each worker's colocated-Python sidecar.
- ``--mode multi-controller``: one process per worker host. It waits for
  ``<ramdisk>/jax-init-info.txt`` (process id, coordinator address), written by
  ``mtc-replicator-k8s --write-jax-init-info``, then ``jax.distributed.initialize``
  with the process count from the JobSet environment.

The workers' replicator addresses come from the JobSet environment (see
``mtc.jobset``). Progress goes to stdout as JSON lines; each step
touches ``--heartbeat`` for the image's HEALTHCHECK.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("mtc.train.k8s")


def emit(**fields: Any) -> None:
    fields.setdefault("t", time.time())
    print(json.dumps(fields), flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(prog="mtc-train-k8s", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("auto", "pathways", "multi-controller"), default="auto")
    p.add_argument("--ramdisk", type=Path, default=Path(env.get("MTC_LOCAL_DIR", "/local")),
                   help="each worker host's RAM disk (env MTC_LOCAL_DIR, default /local)")
    p.add_argument("--steps", type=int, default=1000, help="train up to this step")
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--max-to-keep", type=int, default=None,
                   help="steps kept on the RAM disk (default: the replicators' --keep decides)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="global batch")
    p.add_argument("--compile-cache", default=env.get("MTC_COMPILE_CACHE", ""),
                   help="JAX persistent compilation cache folder, shared by restarted and "
                        "replacement trainers (default: $MTC_COMPILE_CACHE; empty: off; on "
                        "Pathways the servers keep their own)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--replicator-port", type=int,
                   default=int(env.get("MTC_REPLICATOR_PORT", "9470")))
    p.add_argument("--no-replicators", action="store_true",
                   help="restore from the RAM disks only, without asking the replicators")
    p.add_argument("--tls-dir", type=Path,
                   default=Path(env["MTC_TLS_DIR"]) if env.get("MTC_TLS_DIR") else None,
                   help="folder with tls.crt, tls.key, ca.crt to reach the replicators "
                        "(env MTC_TLS_DIR)")
    p.add_argument("--token-file", type=Path, help="the replicators' shared token")
    p.add_argument("--init-timeout", type=float, default=900.0,
                   help="seconds to wait for jax-init-info.txt and the coordinator")
    p.add_argument("--heartbeat", type=Path, default=Path("/tmp/mtc-train.heartbeat"))
    return p.parse_args(argv)


def wait_for_init_info(local_dir: Path, timeout_s: float) -> tuple[int, str]:
    from mtc.jobset import JAX_INIT_INFO, read_jax_init_info

    deadline = time.monotonic() + timeout_s
    while not (local_dir / JAX_INIT_INFO).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {local_dir / JAX_INIT_INFO} after {timeout_s:.0f}s: is "
                             "mtc-replicator-k8s running with --write-jax-init-info?")
        time.sleep(1.0)
    return read_jax_init_info(local_dir)


def init_jax(args: argparse.Namespace) -> str:
    """Connect JAX to the cluster; returns the mode."""
    mode = args.mode
    if mode == "auto":
        mode = "pathways" if os.environ.get("JAX_PLATFORMS") == "proxy" else "multi-controller"
    if mode == "pathways":
        import pathwaysutils

        pathwaysutils.initialize()
        return mode
    import jax

    from mtc.jobset import JobSetPlace

    place = JobSetPlace.from_env()
    process_id, coordinator = wait_for_init_info(args.ramdisk, args.init_timeout)
    if process_id != place.rank:
        raise SystemExit(f"jax-init-info.txt says process {process_id}, the JobSet says "
                         f"rank {place.rank}")
    jax.distributed.initialize(coordinator_address=coordinator,
                               num_processes=place.num_nodes, process_id=process_id,
                               initialization_timeout=int(args.init_timeout))
    return mode


def make_mesh(hosts_per_slice: int) -> Any:
    """Axis ``replica`` across slices, ``model`` within one."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    def slice_of(d: Any) -> int:
        s = getattr(d, "slice_index", None)
        return int(s) if s is not None else d.process_index // hosts_per_slice

    devices = sorted(jax.devices(), key=lambda d: (slice_of(d), d.id))
    num_slices = len({slice_of(d) for d in devices})
    if len(devices) % num_slices:
        raise SystemExit(f"{len(devices)} devices do not split into {num_slices} equal slices")
    return Mesh(np.array(devices).reshape(num_slices, -1), ("replica", "model"))


def checkpoint_options(args: argparse.Namespace, place: Any) -> Any:
    """The manager's options: every worker's replicator (``place``'s addresses, in
    rank order: the replicators' own ``--nodes``, so host ``h`` of mtc's topology
    is the replicator of rank ``h``), reached over mutual TLS with ``--tls-dir``'s
    files and the token of ``--token-file``. Through them the manager agrees on the
    step to restore, gets a replaced host's data from its peer or the backup, and
    (multi-controller) fetches the regions other hosts saved when the mesh changed.
    Each pod's replicator is a container of the pod itself, its name the pod's in
    the JobSet's headless service, which the ``*.<subdomain>`` certificate covers.
    The pod's certificate names the pod: the manager reads such names as ranks as
    the replicators do (``place.pod_names``), so that a copy another replicator
    lists of a rank's data is read only when proven that rank's."""
    import mtc

    tls = args.tls_dir
    token = args.token_file.read_text().strip() if args.token_file else None
    with_replicators = not args.no_replicators
    return mtc.Options(
        save_interval_steps=args.save_interval, max_to_keep=args.max_to_keep,
        hosts_per_slice=place.hosts_per_slice,
        replicators=tuple(place.addresses(args.replicator_port)) if with_replicators else None,
        replicator_token=token if with_replicators else None,
        replicator_tls=(str(tls / "tls.crt"), str(tls / "tls.key"), str(tls / "ca.crt"))
        if tls and with_replicators else None,
        replicator_pod_names=place.pod_names if tls and with_replicators else None)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s train-k8s: %(message)s")
    mode = init_jax(args)

    import jax

    import mtc
    from mtc.jobset import JobSetPlace
    from mtc.trainer import aot
    from mtc.trainer.data import VOCAB, make_iterator
    from mtc.trainer.model import Config, Trainer, count_params

    cache = aot.enable_cache(args.compile_cache or None) if mode != "pathways" else None

    place = JobSetPlace.from_env(worker=mode == "multi-controller")
    mesh = make_mesh(place.hosts_per_slice)
    num_slices = mesh.devices.shape[0]
    emit(event="start", mode=mode, devices=int(mesh.devices.size), slices=int(num_slices),
         compile_cache=cache,
         process=jax.process_index(), processes=jax.process_count())
    cfg = Config(vocab_size=len(VOCAB), d_model=args.d_model, n_heads=args.heads,
                 n_layers=args.layers, d_ff=args.d_ff, total_steps=args.steps)
    trainer = Trainer(cfg, mesh, batch_size=args.batch_size)
    mgr = mtc.CheckpointManager(args.ramdisk, mesh=mesh,
                                options=checkpoint_options(args, place))

    t0 = time.perf_counter()
    # With replicators: they agree on the step (the manager raises ConfigError when
    # their count is not mtc's host count) and make every host's data local.
    step = mgr.latest_step()
    if mode == "multi-controller":
        shard, shards = place.slice_index or 0, num_slices
    else:
        shard, shards = 0, 1
    data = make_iterator(seq_len=cfg.seq_len, global_batch_size=args.batch_size,
                         seed=args.seed, shard_index=shard, shard_count=shards)
    if step is not None:
        state = mgr.restore(step, trainer.abstract_state())
        jax.block_until_ready(state)
        data.set_state(state["data"])
        emit(event="restore", step=step, seconds=time.perf_counter() - t0)
    else:
        state = trainer.init(args.seed)
        jax.block_until_ready(state)
        emit(event="init", seconds=time.perf_counter() - t0,
             params=count_params(state["params"]))
        mgr.save(0, state, force=True)

    global_shape = (args.batch_size, cfg.seq_len + 1)
    for step in range(state["step"] + 1, args.steps + 1):
        t0 = time.perf_counter()
        local = next(data)
        batch = (jax.make_array_from_process_local_data(trainer.batch_sharding, local,
                                                        global_shape)
                 if jax.process_count() > 1 else local)
        state, loss_arr = trainer.step(state, batch)
        state["data"] = data.get_state()
        loss = float(loss_arr)
        t1 = time.perf_counter()
        saved = mgr.save(step, state)
        args.heartbeat.touch()
        emit(step=step, loss=loss, step_s=t1 - t0, save_s=time.perf_counter() - t1,
             saved=saved)
    mgr.wait_until_finished()
    mgr.close()
    emit(event="done", step=state["step"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
