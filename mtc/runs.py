"""Run identities: which run of a job wrote a step.

A step restored later must hold one run's bytes on every host. A job that
restarts, restores step S and saves S+5 again may meet an S+5 that an earlier
run committed on some hosts only (it died between hosts' commits): the two are
different checkpoints under one number. Every manifest names the run that wrote
it (:attr:`mtc.manifest.Manifest.run`), and a step whose hosts name different
runs is never offered nor restored (:func:`one_run`).

A run identity is fixed when a manager starts and again after each restore: in
multi-controller JAX every process takes process 0's, so one save's hosts name
one run.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

import numpy as np


def new_run_id() -> str:
    """A fresh run identity (16 hex digits)."""
    return os.urandom(8).hex()


def shared_run_id() -> str:
    """A fresh run identity, the same in every process of the job (collective in
    multi-controller JAX: every process must call it)."""
    import jax

    mine = new_run_id()
    if jax.process_count() == 1:
        return mine
    from jax.experimental import multihost_utils

    raw = np.frombuffer(bytes.fromhex(mine), dtype=np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(raw))
    return bytes(everyone.reshape(jax.process_count(), -1)[0].astype(np.uint8)).hex()


def run_key(run: str) -> int:
    """A run identity as a non-negative int64, for comparing across processes (a
    run written before identities existed, "", is 0)."""
    if not run:
        return 0
    return int.from_bytes(hashlib.sha256(run.encode()).digest()[:8], "big") & (2**62 - 1) | 1


def one_run(runs: Mapping[int, str]) -> str | None:
    """The run every host's manifest of a step names (``runs``: host -> run), or None
    when they name different runs: the step mixes two runs' bytes."""
    found = set(runs.values())
    return found.pop() if len(found) == 1 else None


def describe_mix(runs: Mapping[int, str]) -> str:
    """Which hosts hold which run, for an error message."""
    by_run: dict[str, list[int]] = {}
    for h, r in sorted(runs.items()):
        by_run.setdefault(r, []).append(h)
    return "; ".join(f"hosts {hosts} run {r or '(none recorded)'}" for r, hosts in
                     sorted(by_run.items(), key=lambda kv: kv[1]))
