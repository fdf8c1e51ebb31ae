"""The seam audit's stricter mode for hosts that run their own sidecar processes:
the controller's in-process host side (``LocalDispatch``) is a leak there, the
test harness playing the host is not."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import seam_audit
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc


def _save_in_process(base: Path) -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "model"))
    w = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8),
                       NamedSharding(mesh, P("replica", "model")))
    opts = mtc.Options(simulated_hosts=2, hosts_per_slice=1, dispatch="local")
    with mtc.CheckpointManager(base, mesh=mesh, options=opts) as m:
        assert m.save(1, {"w": w})
        m.wait_until_finished()


def test_in_process_host_side_is_a_leak_once_hosts_have_sidecars(tmp_path: Path) -> None:
    plain, strict = tmp_path / "plain", tmp_path / "strict"
    for base in (plain, strict):
        base.mkdir()
        seam_audit.watch(base)
    seam_audit.sidecars_only(strict)
    try:
        _save_in_process(plain)   # host-side frames: allowed by the plain audit
        _save_in_process(strict)  # the same, where the hosts have sidecars: leaks
    finally:
        leaks = seam_audit.unwatch(strict) + seam_audit.unwatch(plain)
    assert leaks, "the in-process host side went unnoticed"
    assert all(str(strict) in leak for leak in leaks), [x for x in leaks if str(plain) in x]
    assert any("mtc/" in leak for leak in leaks), leaks[:5]
    # The harness plays the host: a test frame reading and damaging files is no leak,
    # nor host-side code the test calls (a checksum, say).
    from mtc.sidecar.storage.checksum import file_crc

    seam_audit.watch(strict)
    seam_audit.sidecars_only(strict)
    try:
        shard = next(p for p in (strict / "host-0" / "1").iterdir() if p.suffix == ".bin")
        shard.write_bytes(shard.read_bytes()[::-1])
        assert file_crc(shard)[0] == shard.stat().st_size
    finally:
        assert seam_audit.unwatch(strict) == []
