"""Agreement across JAX processes in multi-controller runs."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

# Steps compared across processes: enough for any sane retention policy.
WINDOW = 64


def common_steps(local: Sequence[int]) -> list[int]:
    """Steps committed in every process (collective: every process must call it)."""
    if jax.process_count() == 1:
        return sorted(local)
    from jax.experimental import multihost_utils

    mine = np.full(WINDOW, -1, dtype=np.int64)
    newest = sorted(local)[-WINDOW:]
    mine[:len(newest)] = newest
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    common = set(newest)
    for row in everyone.reshape(jax.process_count(), WINDOW):
        common &= {int(s) for s in row if s >= 0}
    return sorted(common)
