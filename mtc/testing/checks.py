"""What a restore-after-failure test asserts: where each host's data came from, and
that the restored values are exactly a reference run's.

:func:`record_restores` notes every ``CheckpointManager.restore`` of this process
(the step and each host's tier), so a test asserts on a training function it
does not change; :func:`assert_tiers` and :func:`assert_same_values` say what
differs, by host and by leaf path.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

TIERS = ("local", "peer", "backup")


@dataclasses.dataclass(frozen=True)
class Restore:
    """One ``CheckpointManager.restore``: the step it restored (the newest one when
    none was asked for) and, per host, the tier its data came from
    (``last_restore_tiers``)."""

    step: int
    tiers: dict[int, str]


@contextmanager
def record_restores() -> Iterator[list[Restore]]:
    """Every ``mtc.CheckpointManager.restore`` that returns inside the block, in order
    (this process's managers: a script's are its own)."""
    import mtc

    seen: list[Restore] = []
    real = mtc.CheckpointManager.restore

    def restore(self: mtc.CheckpointManager, step: Any = None, *args: Any, **kw: Any) -> Any:
        out = real(self, step, *args, **kw)
        restored = self.last_restore_step
        assert restored is not None  # set by every restore that returns
        seen.append(Restore(restored, dict(self.last_restore_tiers)))
        return out

    mtc.CheckpointManager.restore = restore  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        mtc.CheckpointManager.restore = real  # type: ignore[method-assign]


def tier_problems(got: Mapping[int, str], want: Mapping[int, str] | str) -> list[str]:
    """Hosts whose tier is not the one wanted (``want``: per host, or one for all)."""
    wanted = {h: want for h in got} if isinstance(want, str) else dict(want)
    for t in wanted.values():
        if t not in TIERS:
            raise ValueError(f"tier {t!r}: one of {TIERS}")
    return [f"host {h}: {got.get(h, 'nothing restored')} (wanted {t})"
            for h, t in sorted(wanted.items()) if got.get(h) != t]


def assert_tiers(restore: Restore | Mapping[int, str], want: Mapping[int, str] | str) -> None:
    """Each host's data came from the tier wanted: ``{0: "local", 1: "peer"}`` (hosts
    left out are not checked), or one tier for every host."""
    got = restore.tiers if isinstance(restore, Restore) else restore
    problems = tier_problems(got, want)
    assert not problems, f"restored from other tiers: {'; '.join(problems)} (all: {got})"


def value_problems(got: Any, want: Any, limit: int = 10) -> list[str]:
    """Leaves that differ (by key path): structure, kind of leaf (a Python ``int`` is
    not a ``numpy.int64``, nor a ``float`` a ``numpy.float64``), dtype, shape, or any
    element's bits (``0.0`` is not ``-0.0``; a NaN equals only a NaN of the same
    payload)."""
    import jax

    g, gdef = jax.tree_util.tree_flatten_with_path(got)
    w, wdef = jax.tree_util.tree_flatten_with_path(want)
    if str(gdef) != str(wdef):  # PyTreeDef has no typed comparison
        return [f"tree structure differs: {gdef} != {wdef}"]
    out = []
    for (path, a), (_, b) in zip(g, w, strict=True):
        problem = leaf_problem(a, b)
        if problem:
            out.append(f"{jax.tree_util.keystr(path) or '<root>'}: {problem}")
    return out[:limit]


_PYTHON_LEAVES = (bool, int, float, complex, str, bytes, type(None))


def _kind(x: Any) -> str:
    import numpy as np

    if isinstance(x, np.generic):  # before Python's: a numpy.float64 is a float
        return f"numpy.{type(x).__name__}"
    if isinstance(x, _PYTHON_LEAVES):
        return type(x).__name__
    return "array"  # numpy's or JAX's: what counts is the dtype, shape and bits


def _bits(x: Any) -> Any:
    """``x`` as a numpy array whose bytes are its value (a PRNG key: its key data)."""
    import jax
    import numpy as np

    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def leaf_problem(a: Any, b: Any) -> str:
    """How one leaf differs from another ("": it does not), bit for bit."""
    import numpy as np

    ka, kb = _kind(a), _kind(b)
    if ka != kb:
        return f"{ka} != {kb}"
    if ka in ("bool", "int", "str", "bytes", "NoneType"):
        return "" if a == b else f"{a!r} != {b!r}"
    x, y = _bits(a), _bits(b)
    if x.dtype != y.dtype or x.shape != y.shape:
        return f"{x.dtype}{list(x.shape)} != {y.dtype}{list(y.shape)}"
    if x.dtype.hasobject:  # no bits to compare: Python's equality, element by element
        bad = int(np.sum(x != y))
    else:
        n = x.dtype.itemsize
        xb = x.reshape(-1).view(np.uint8).reshape(x.size, n)
        yb = y.reshape(-1).view(np.uint8).reshape(y.size, n)
        bad = int(np.sum(np.any(xb != yb, axis=1)))
    if bad == 0:
        return ""
    if x.ndim == 0:
        return f"{x.item()!r} != {y.item()!r} (bits {x.tobytes().hex()} != {y.tobytes().hex()})"
    return f"{bad} of {x.size} elements differ"


def assert_same_values(got: Any, want: Any) -> None:
    """``got`` (a restored or resumed state) equals ``want`` (a reference run's) leaf
    for leaf, bit for bit: the same tree, the same kind of leaf (a Python ``int`` is
    not a ``numpy.int64``), dtypes, shapes and bits (``-0.0`` differs from ``0.0``,
    NaNs differ by payload). Equal values do not prove a restore happened: assert
    that too (:func:`record_restores`, or the ``mtc_restores`` fixture)."""
    problems = value_problems(got, want)
    assert not problems, "values differ from the reference:\n  " + "\n  ".join(problems)


def use_cpu_devices(n: int = 8) -> None:
    """Make JAX in this process (and the scripts a cluster runs) see ``n`` CPU devices:
    before JAX has made its backends. Set in the environment, and refused if JAX
    already runs with another device count."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    if m is None:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    elif int(m.group(1)) != n:
        raise RuntimeError(f"XLA_FLAGS asks for {m.group(1)} CPU devices, not {n}")
    import jax

    if jax.device_count() != n:
        raise RuntimeError(f"JAX runs with {jax.device_count()} devices, not {n} CPU "
                           "devices: call mtc.testing.use_cpu_devices before any JAX "
                           "computation (or set XLA_FLAGS=--xla_force_host_platform_"
                           f"device_count={n} JAX_PLATFORMS=cpu)")
