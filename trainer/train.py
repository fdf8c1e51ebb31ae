"""One training process of the demo: train the LM, checkpointing with mtc.

Run as ``python -m mtc.trainer.train --ramdisk DIR --log FILE [--resume]``. The
process builds a 2-slice x 4-device mesh over 8 CPU devices, groups them into 4
simulated hosts (2 per slice), and saves every ``--save-interval`` steps to
their RAM-disk roots under ``--ramdisk``. With ``--resume`` it first restores
``latest_step()`` and the data iterator's position from that checkpoint.

It writes one JSON object per line to ``--log`` (line-buffered, so a line that
was written survives a SIGKILL): events ``start``, ``ready``, ``init`` or
``restore``, then one line per step ``{"step", "loss", "t", "step_s", "save_s",
"saved"}``, then ``done``. ``t`` is wall-clock time (``time.time()``) so that
another process can line events up; durations use ``perf_counter``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from jax.sharding import Mesh

import mtc
from mtc.trainer import aot
from mtc.trainer.data import VOCAB, make_iterator
from mtc.trainer.jsonlog import JsonLog
from mtc.trainer.model import PRESETS, Config, Trainer, count_params


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ramdisk", type=Path, help="mtc local_dir (one host-<i> root per host)")
    p.add_argument("--sidecars", default="",
                   help="the hosts' sidecar addresses, comma-separated (host order): save and "
                        "restore through them; this process then never sees a RAM disk")
    p.add_argument("--token-file", type=Path,
                   help="the token the sidecars require (the hosts' peer token)")
    p.add_argument("--log", type=Path, required=True, help="JSON-lines output")
    p.add_argument("--steps", type=int, default=150, help="train up to this step")
    p.add_argument("--model", choices=sorted(PRESETS), default="small",
                   help="model size preset (small: 3.2M parameters; tiny: 0.4M)")
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--max-to-keep", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--resume", action="store_true", help="restore mtc's latest step first")
    p.add_argument("--compile-cache", default=os.environ.get("MTC_COMPILE_CACHE", ""),
                   help="JAX persistent compilation cache folder or URL, shared by restarted "
                        "processes (default: $MTC_COMPILE_CACHE; empty: off)")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="train without mtc (the uninterrupted reference run)")
    args = p.parse_args(argv)
    if not args.no_checkpoint and args.ramdisk is None:
        p.error("--ramdisk is required unless --no-checkpoint")
    if args.resume and args.no_checkpoint:
        p.error("--resume needs checkpoints")
    return args


def make_mesh() -> Mesh:
    devices = jax.devices()
    if len(devices) != 8:
        raise SystemExit(f"need 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), "
                         f"got {len(devices)}")
    return Mesh(np.array(devices).reshape(2, 4), ("replica", "model"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = JsonLog(args.log)
    log.write(event="start", pid=os.getpid())
    cache = aot.enable_cache(args.compile_cache or None)

    mesh = make_mesh()
    cfg = Config.preset(args.model, vocab_size=len(VOCAB), total_steps=args.steps)
    trainer = Trainer(cfg, mesh, batch_size=args.batch_size)
    data = make_iterator(seq_len=cfg.seq_len, global_batch_size=args.batch_size, seed=args.seed)
    mgr = None
    if not args.no_checkpoint:
        mgr = mtc.CheckpointManager(
            args.ramdisk, mesh=mesh,
            options=mtc.Options(save_interval_steps=args.save_interval,
                                max_to_keep=args.max_to_keep,
                                simulated_hosts=4, hosts_per_slice=2,
                                replicator_token=(args.token_file.read_text().strip()
                                                  if args.token_file else None),
                                sidecars=tuple(args.sidecars.split(",")) if args.sidecars
                                else None))
    log.write(event="ready", compile_cache=cache,
              dispatch=mgr.dispatch_mode if mgr is not None else None)

    t0 = time.perf_counter()
    if args.resume:
        assert mgr is not None
        step = mgr.latest_step()
        if step is None:
            raise SystemExit(f"--resume: no committed step under {args.ramdisk}")
        state = mgr.restore(step, trainer.abstract_state())
        jax.block_until_ready(state)
        if state["step"] != step:
            raise SystemExit(f"checkpoint {step} holds state of step {state['step']}")
        data.set_state(state["data"])
        log.write(event="restore", step=step, seconds=time.perf_counter() - t0, tier="local")
    else:
        state = trainer.init(args.seed)
        jax.block_until_ready(state)
        log.write(event="init", seconds=time.perf_counter() - t0,
                  params=count_params(state["params"]))
        if mgr is not None:
            mgr.save(0, state)

    logged_use = False
    for step in range(state["step"] + 1, args.steps + 1):
        t0 = time.perf_counter()
        batch = next(data)
        state, loss_arr = trainer.step(state, batch)
        state["data"] = data.get_state()
        loss = float(loss_arr)  # waits for the step
        t1 = time.perf_counter()
        saved = mgr.save(step, state) if mgr is not None else False
        t2 = time.perf_counter()
        first: dict[str, object] = {}
        if not logged_use:
            # The process's first step: its executable came from the cache or a compile.
            use = trainer.uses["step"]
            first = {"executable": use.source, "compile_s": use.compile_s}
            logged_use = True
        log.write(step=step, loss=loss, step_s=t1 - t0, save_s=t2 - t1, saved=saved, **first)

    t0 = time.perf_counter()
    if mgr is not None:
        mgr.wait_until_finished()
        mgr.close()
    log.write(event="done", step=state["step"], final_wait_s=time.perf_counter() - t0)
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
