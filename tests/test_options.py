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
    # How a pod's certificate names its rank: a JobSet's prefix and hosts, with TLS.
    ({"replicator_pod_names": ("mtc-train-worker-", 2)}, "goes with replicator_tls"),
    ({"replicator_pod_names": ("mtc-train-worker", 2), "replicator_tls": ("c", "k", "a")},
     "is not <jobset>-<replicated job>-"),
    ({"replicator_pod_names": ("mtc-train-worker-", 0), "replicator_tls": ("c", "k", "a")},
     "hosts per slice 0"),
    ({"replicator_pod_names": ("mtc-train-worker-",), "replicator_tls": ("c", "k", "a")},
     r"\(pod prefix, hosts per slice\)"),
    ({"replicator_pod_names": ("mtc-train-worker-", "2"), "replicator_tls": ("c", "k", "a")},
     r"\(pod prefix, hosts per slice\)"),
])
def test_bad_replicator_options_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(mtc.ConfigError, match=match):
        mtc.Options(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("addresses, ranks, match", [
    (4, (0, 1), "2 replicator ranks for 4 hosts"),
    (3, None, "3 replicator addresses for 4 hosts"),
])
def test_the_job_states_one_rank_per_host(tmp_path: Path, mesh: Mesh, addresses: int,
                                          ranks: tuple[int, ...] | None, match: str) -> None:
    """A membership or an address list the size of which is not the job's host
    count is refused before any replicator is asked (nothing listens at these
    addresses)."""
    opts = mtc.Options(simulated_hosts=4, dispatch="local",
                       replicators=tuple(f"127.0.0.1:{9 + i}" for i in range(addresses)),
                       replicator_ranks=ranks)
    with mtc.CheckpointManager(tmp_path, mesh=mesh, options=opts) as m, \
            pytest.raises(mtc.ConfigError, match=match):
        m.latest_step()


def test_the_reference_lists_every_option() -> None:
    """docs/reference.md's Options table has a row for every field of mtc.Options."""
    import dataclasses
    import re

    ref = (Path(__file__).resolve().parents[1] / "docs" / "reference.md").read_text()
    table = ref[ref.index("## `mtc.Options`"):ref.index("## Errors")]
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", table, flags=re.M))
    assert rows == {f.name for f in dataclasses.fields(mtc.Options)}
