"""Options that reach the replicators: validated when made, stated when used."""

from __future__ import annotations

from pathlib import Path

import pytest
from jax.sharding import Mesh

import mtc


@pytest.mark.parametrize(("kw", "match"), [
    ({"replicator_ranks": (0, 0)}, "distinct ranks"),
    ({"replicator_ranks": (-1, 1)}, "distinct ranks"),
    ({"replicator_tls": ("c", "k")}, r"\(certificate, key, CA\)"),
    ({"replicator_tls": ("c", "", "a")}, r"\(certificate, key, CA\)"),
])
def test_bad_replicator_options_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(mtc.ConfigError, match=match):
        mtc.Options(**kw)  # type: ignore[arg-type]


def test_the_job_states_one_rank_per_host(tmp_path: Path, mesh: Mesh) -> None:
    """A membership the size of which is not the job's host count is refused before
    any replicator is asked (nothing listens at these addresses)."""
    opts = mtc.Options(simulated_hosts=4, dispatch="local",
                       replicators=tuple(f"127.0.0.1:{9 + i}" for i in range(4)),
                       replicator_ranks=(0, 1))
    with mtc.CheckpointManager(tmp_path, mesh=mesh, options=opts) as m, \
            pytest.raises(mtc.ConfigError, match="2 replicator ranks for 4 hosts"):
        m.latest_step()
