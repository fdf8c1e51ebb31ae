"""JAX's extra dtypes through a sidecar process, which imports ``ml_dtypes`` only
when the first such dtype comes (it is most of a sidecar's start-up)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from replicators import Cluster, env_with_repo, new_cluster

import mtc

pytestmark = pytest.mark.process  # every test here starts processes

DTYPES = (jnp.bfloat16, jnp.float8_e4m3fn, jnp.int4, jnp.float32)


def test_sidecar_starts_without_ml_dtypes_and_resolves_them_on_demand() -> None:
    code = ("import sys, mtc.sidecar.host.main\n"
            "from mtc.sidecar.dtypes import numpy_dtype\n"
            "assert 'ml_dtypes' not in sys.modules, 'imported at start-up'\n"
            "assert numpy_dtype('float32').itemsize == 4 and 'ml_dtypes' not in sys.modules\n"
            "print(numpy_dtype('bfloat16'), numpy_dtype('bfloat16').itemsize)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=env_with_repo())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["bfloat16", "2"]


def test_extra_dtypes_saved_and_restored_through_sidecars(ramdisk: Path,
                                                          clusters: list[Cluster]) -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "model"))
    state = {f"x{i}": jax.device_put(
                 (jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) % 7 - 3).astype(dt),
                 NamedSharding(mesh, P(("replica", "model"))))
             for i, dt in enumerate(DTYPES)}
    cl = new_cluster(clusters, ramdisk, 2, 1)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=cl.options()) as m:
        assert m.save(1, state)
        m.wait_until_finished()
    cl.kill_sidecar(0)  # a fresh sidecar reads them back (nothing imported yet)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=cl.options()) as m:
        got = m.restore(1, target=state)
    for k, want in state.items():
        assert got[k].dtype == want.dtype, k
        assert got[k].sharding == want.sharding, k
        np.testing.assert_array_equal(np.asarray(got[k].astype(jnp.float32)),
                                      np.asarray(want.astype(jnp.float32)))
