"""The replicators' control plane at scale, by simulation (issue 11, item 6).

N simulated nodes (2 slices, ``replicas=1``) over an in-memory transport that
counts every control RPC. Run for real: restore agreement (``Coordinator``,
``Book``, ``decide``), the coordinator's view for GC (``gc_keeps`` in a ``Fresh``,
asked by every node at once from a thread pool, as their GC passes do), GC's
plan (``gc_plan``) and the backup plan's input (``newest_complete``). Counted by
the rules the replicator follows (a fan-out's latency is modelled: a 1 ms
round trip plus 20 us of sender CPU per call; GC passes arrive spread over one
0.2 s poll interval): target resyncs (each target every 2 s),
replication (Offer, Link, Commit per target and save), backup leadership (one
call a node every 0.5 s; the leader gathers every inventory each pass).

Reference in the same run: the previous protocol's message pattern on the same
N (every node gathered every inventory before GC, and proposed to every node
in every round of agreement), and for decision time one in-memory gather of all
N inventories. Prints one JSON object; with matplotlib, draws
out/bench/control_plane.png.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from mtc.sidecar.replicator.agree.agreement import Coordinator  # noqa: E402
from mtc.sidecar.replicator.agree.book import Book  # noqa: E402
from mtc.sidecar.replicator.agree.decision import Holding, gc_keeps, newest_complete  # noqa: E402
from mtc.sidecar.replicator.agree.fresh import Fresh  # noqa: E402
from mtc.sidecar.replicator.config import GC_VIEW_INTERVAL_S  # noqa: E402
from mtc.sidecar.replicator.copies.gc import GcInputs, gc_plan  # noqa: E402

SIZES = (4, 16, 64, 256, 1024)
SAVE_S = 10.0  # a save every 10 s
RESYNC_S = 2.0
BACKUP_POLL_S = 0.5
SIM_S = 60.0  # simulated seconds of steady state
POLL_S = 0.2  # GC passes of the N nodes arrive spread over one poll interval
RTT_S = 0.001  # modelled network round trip of one fan-out
PER_CALL_S = 20e-6  # modelled CPU of the sender per gRPC call in a fan-out


class Transport:
    """In-memory: every node's holdings, a counter of RPCs by name."""

    def __init__(self, n: int, newest: int) -> None:
        self.n = n
        self.holdings: dict[int, Holding] = {}
        self.set_newest(newest)
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def set_newest(self, newest: int) -> None:
        """Each node holds its own two newest steps and its peer's (other slice)."""
        per_slice = self.n // 2
        for r in range(self.n):
            peer = (r + per_slice) % self.n
            copies = {(r, s) for s in (newest - 1, newest)} | \
                     {(peer, s) for s in (newest - 1, newest)}
            self.holdings[r] = Holding(frozenset(copies), frozenset({newest - 5}))

    def count(self, name: str, k: int = 1) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + k

    def gather(self, ranks: Sequence[int], deadline: float) -> dict[int, Holding]:
        """One parallel fan-out: a round trip plus the sender's CPU per call (modelled,
        by sleeping: an in-memory answer alone would take microseconds)."""
        k = sum(1 for r in ranks if r != 0)
        self.count("GetInventory", k)
        time.sleep(RTT_S + PER_CALL_S * k)
        return {r: self.holdings[r] for r in ranks}

    def total(self) -> int:
        return sum(self.counts.values())


def own_only(r: int) -> list[int]:
    return [r]


def decision(n: int, samples: int = 5) -> dict[str, Any]:
    """Every node asks for the restore step at once; the coordinator decides. The
    median of ``samples`` decisions, each on a fresh coordinator, after a warm-up."""
    times = []
    with ThreadPoolExecutor(n) as ex:  # every ask waits at once, as on the server
        warm = threading.Barrier(n)
        list(ex.map(lambda _: warm.wait(), range(n)))  # n threads exist before timing
        for _ in range(samples + 1):
            t = Transport(n, newest=7)
            coord = Coordinator(list(range(n)), own_only, t.gather, Book())

            def ask(r: int, t: Transport = t, coord: Coordinator = coord) -> int:
                if r != 0:
                    t.count("Decide")
                return coord.decide_for(r, "rid", 30.0).step

            t0 = time.perf_counter()
            steps = set(ex.map(ask, range(n)))
            times.append(time.perf_counter() - t0)
            assert steps == {7}, steps
    times = times[1:]  # the first is the warm-up
    ref = Transport(n, newest=7)
    t0 = time.perf_counter()
    ref.gather(range(n), 0.0)  # the irreducible part: one fan-out
    gather_s = time.perf_counter() - t0
    return {"messages": t.total(), "seconds": statistics.median(times),
            "seconds_max": max(times), "gather_seconds": gather_s,
            # previous protocol, one round: every node gathered N-1 inventories and
            # proposed to N-1 nodes (at least one round; more when any was late)
            "reference_messages": 2 * n * (n - 1)}


def steady_state(n: int) -> dict[str, Any]:
    """Control RPCs per node per second over SIM_S simulated seconds."""
    t = Transport(n, newest=7)
    members = list(range(n))
    gathers = [0]

    def compute() -> frozenset[int]:
        gathers[0] += 1
        return gc_keeps(t.gather(members, 0.0), n, own_only)

    fresh = Fresh(compute, min_interval_s=GC_VIEW_INTERVAL_S)
    saves = int(SIM_S / SAVE_S)
    for save in range(saves):
        step = 8 + save
        t.set_newest(step)  # committed and replicated everywhere
        # Replication of the new step to each node's one target: Offer, Link, Commit.
        t.count("Offer", n)
        t.count("Link", n)
        t.count("Commit", n)
        # GC after the save: every node's plan wants to delete its oldest step, so
        # each asks the coordinator's fresh complete view at once.
        x = GcInputs(own=(step - 2, step - 1, step), replicated=(step - 2, step - 1, step),
                     replicas={}, keep=2, busy=frozenset(), synced=True,
                     linked=frozenset(), rank=1)
        assert gc_plan(x, None).needs_coordinator

        t0 = time.monotonic()

        def gc(r: int, t0: float = t0, x: GcInputs = x) -> int:
            time.sleep(max(0.0, t0 + POLL_S * r / n - time.monotonic()))
            if r != 0:
                t.count("GetComplete")
            return len(gc_plan(x, fresh.get(30.0)).own)

        with ThreadPoolExecutor(min(n, 256)) as ex:
            deleted = sum(ex.map(gc, range(n)))
        assert deleted == n  # each node deletes its oldest step, keeps the complete one
    t.count("GetInventory(resync)", int(n * SIM_S / RESYNC_S))
    polls = int(SIM_S / BACKUP_POLL_S)
    t.count("GetInventory(backup leads)", (n - 1) * polls)
    t.count("GetInventory(backup plan)", (n - 1) * polls)
    assert newest_complete(t.holdings, n, own_only) == 7 + saves
    per_node = t.total() / n / SIM_S
    no_backup = (t.total() - 2 * (n - 1) * polls) / n / SIM_S
    # The same schedule, previous GC: every node gathered all N-1 inventories.
    ref = t.total() - t.counts.get("GetComplete", 0) - gathers[0] * (n - 1) + \
        saves * n * (n - 1)
    return {"per_node_s": per_node, "per_node_s_without_backup": no_backup,
            "coordinator_gathers_per_save": gathers[0] / saves,
            "reference_per_node_s": ref / n / SIM_S,
            "counts": dict(sorted(t.counts.items()))}


def main() -> None:
    rows = []
    for n in SIZES:
        d = decision(n)
        s = steady_state(n)
        rows.append({
            "n": n,
            "messages_per_node_s": round(s["per_node_s"], 3),
            "messages_per_node_s_without_backup": round(s["per_node_s_without_backup"], 3),
            "reference_messages_per_node_s": round(s["reference_per_node_s"], 3),
            "steady_ratio_vs_reference": round(s["per_node_s"] / s["reference_per_node_s"], 4),
            "coordinator_gathers_per_save": s["coordinator_gathers_per_save"],
            "decision_messages": d["messages"],
            "decision_messages_per_node": round(d["messages"] / n, 3),
            "reference_decision_messages": d["reference_messages"],
            "decision_seconds": round(d["seconds"], 4),
            "decision_seconds_max": round(d["seconds_max"], 4),
            "decision_over_one_gather": round(d["seconds"] / max(d["gather_seconds"], 1e-9), 1),
        })
    out = {"benchmark": "control_plane", "simulated_seconds": SIM_S, "save_every_s": SAVE_S,
           "note": "in-memory transport; CPU shared with other jobs", "rows": rows}
    print(json.dumps(out, indent=1))
    _plot(rows)


def _plot(rows: list[dict[str, Any]]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ns = [r["n"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.loglog(ns, [r["messages_per_node_s"] for r in rows], "o-", label="now")
    a.loglog(ns, [r["reference_messages_per_node_s"] for r in rows], "s--", label="before")
    a.set_xlabel("nodes")
    a.set_ylabel("control RPCs per node per second")
    a.legend()
    b.loglog(ns, [r["decision_messages"] for r in rows], "o-", label="now")
    b.loglog(ns, [r["reference_decision_messages"] for r in rows], "s--", label="before")
    b.set_xlabel("nodes")
    b.set_ylabel("messages per restore decision")
    b.legend()
    fig.tight_layout()
    out = REPO / "out" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "control_plane.png", dpi=100)


if __name__ == "__main__":
    main()
