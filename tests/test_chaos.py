"""A short run of the chaos driver (``make chaos`` runs up to 200 cycles): real
replicator processes, a real trainer process, real SIGKILLs, wipes and damaged
shards; every restore is checked value by value against the function of its step."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.process
def test_chaos_short_run() -> None:
    base = Path("/dev/shm") / f"mtc-cluster-chaos-test-{uuid.uuid4().hex[:8]}"
    r = subprocess.run([sys.executable, "-m", "mtc.trainer.chaos", "--cycles", "3",
                        "--seconds", "45", "--seed", "3", "--base", str(base)],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(out)
    assert out["cycles"] >= 3
    assert out["corrupt"] == 0 and out["divergent"] == 0 and out["hangs"] == 0, out
    assert out["ok"] + sum(out["errors"].values()) + out["stale"] == out["cycles"], out
    assert out["ok"] >= 1 and out["restore_s"]["max"] > 0
    assert sum(out["faults"].values()) == out["cycles"]
    assert out["isolation"] in ("namespaces", "processes")
    assert out["dispatch"] == "colocated"  # Pathways' path, the default
    assert not base.exists()  # the cluster was taken down
    # ... with every process it started, restarted ones included.
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(base) in (proc / "cmdline").read_bytes().decode(
                    errors="replace"):
                left.append(proc.name)
        except OSError:
            continue
    assert left == [], f"processes of the chaos cluster left running: {left}"


# -- network faults: the pure parts (the real ones run in tests/test_network_faults.py) --


class _Hosts:
    """Records what the driver asks of the network (stands in for isolation.Hosts)."""

    isolation = "namespaces"

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def link(self, host: int, up: bool) -> None:
        self.calls.append(("link", host, up))

    def partition(self, groups: list[list[int]]) -> None:
        self.calls.append(("partition", groups))

    def heal(self) -> None:
        self.calls.append(("heal",))


def test_network_faults_are_drawn_only_on_isolated_hosts() -> None:
    import random
    import types

    from mtc.trainer import chaos, chaos_net

    assert chaos_net.network_of(types.SimpleNamespace()) is None  # today's LocalCluster
    assert chaos_net.network_of(types.SimpleNamespace(hosts=object())) is None
    processes = _Hosts()
    processes.isolation = "processes"  # no namespaces: nothing to cut
    assert chaos_net.network_of(types.SimpleNamespace(hosts=processes)) is None
    hosts = _Hosts()
    assert chaos_net.network_of(types.SimpleNamespace(hosts=hosts)) is hosts
    assert chaos.fault_kinds(None) == (chaos.FAULTS, chaos.WEIGHTS)
    kinds, weights = chaos.fault_kinds(hosts)
    assert set(chaos_net.NET_FAULTS) <= set(kinds) and len(kinds) == len(weights)
    rng = random.Random(5)
    slices = [[0, 1], [2, 3]]
    for kind in chaos_net.NET_FAULTS:
        f = chaos_net.plan_net_fault(kind, 2, slices, rng)
        assert chaos_net.HEAL_AFTER_S[0] <= f.heal_after_s <= chaos_net.HEAL_AFTER_S[1]
        assert f.during_restore == kind.endswith("_in_restore")
        chaos_net.cut(hosts, f)
    assert hosts.calls == [("link", 2, False), ("link", 2, False),
                           ("partition", [[0, 1], [2, 3]])]
    with pytest.raises(ValueError):
        chaos_net.plan_net_fault("bit_flip", 0, slices, rng)
