"""``make chaos``: random faults over the local cluster, every restore checked exactly.

    python -m mtc.trainer.chaos [--cycles 200] [--seconds 600] [--seed 0]

Starts a local cluster (``mtc.trainer.cluster``: 2 slices of 2 simulated hosts
that share nothing, each its own sidecar and replicator process and RAM disk,
backups to a folder) and a trainer process whose state is a function of the
step (tiny arrays), saving through the sidecars. Each cycle injects one fault,
then has the trainer restore through the replicators (``restore()`` without a
step), compare every restored value with the function of the restored step, and
save two more steps. Faults: SIGKILL of the trainer (mid-restore or mid-save),
of a replicator (while idle or during the restore) or of a sidecar (its
replicator keeps the RAM disk, as a pod's volume outlives a container), a host
wipe (every process of the host killed, RAM disk lost, started empty), a bit
flip or a truncation of a shard in the newest committed step (some "silent":
size and mtime kept, as bad memory would), done on the host itself (a process
in its namespaces). With network namespaces (root; see :func:`network_of`) also
network faults: a host's link cut before the restore or during it, the slices
partitioned from each other during it, healed after up to a few seconds (a
fault outlasting the restore's deadline ends in a typed error, counted by
type). Without them they are not injected, and the JSON line says so.

Prints one JSON line: cycles, ok, corrupt (a value differs), divergent (hosts
restored different steps), stale (older than the newest step every host had
committed and replicated before the fault), errors by type, hangs (no answer
within the cycle deadline), restore seconds (median, max), faults by kind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtc.testing.local_cluster import REPO, LocalCluster, _env, default_base
from mtc.trainer.chaos_net import NET_FAULTS, NET_WEIGHTS, Network, cut, network_of, plan_net_fault

if TYPE_CHECKING:  # the driver itself imports no JAX
    from mtc.options import Dispatch

FAULTS = ("none", "kill_trainer", "kill_replicator", "kill_replicator_in_restore",
          "kill_sidecar", "wipe_host", "bit_flip", "silent_bit_flip", "truncate")
WEIGHTS = (1, 1, 2, 2, 1, 2, 3, 2, 2)
CYCLE_DEADLINE_S = 90.0
TRAINER_DEVICES = 8  # the trainer's CPU devices: a 2x4 mesh (replica, model)


# -- the trainer ------------------------------------------------------------------------


def state_of(step: int, mesh: Any) -> dict[str, Any]:
    """The training state after ``step``: every value a function of the step."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    w = (jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) + step) * 0.5
    dp = jnp.arange(32 * 16, dtype=jnp.int32).reshape(32, 16) * (step + 1)
    return {"w": jax.device_put(w, NamedSharding(mesh, P(("replica", "model")))),
            "dp": jax.device_put(dp, NamedSharding(mesh, P("model"))), "step": step}


def worker(base: Path, dispatch: Dispatch) -> int:
    """Serve the driver's commands on stdin: ``cycle`` restores, checks, saves two steps;
    ``dispatch``: colocated (Pathways' path: programs the hosts' sidecars run) or process."""
    os.environ.setdefault("XLA_FLAGS",
                          f"--xla_force_host_platform_device_count={TRAINER_DEVICES}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's "where are you"
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import mtc
    from mtc.errors import MtcError

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "model"))
    cluster = LocalCluster.load(base)  # the hosts keep their addresses when replaced
    opts = mtc.Options(simulated_hosts=4, hosts_per_slice=2, max_to_keep=None,
                       dispatch=dispatch, sidecars=cluster.sidecars(),
                       replicators=tuple(cluster.addresses),
                       replicator_token=cluster.token(), restore_timeout_s=30)
    target = state_of(0, mesh)

    def say(**kw: Any) -> None:
        print(json.dumps(kw), flush=True)

    say(ready=True)
    with mtc.CheckpointManager(base / "controller", mesh=mesh, options=opts) as m:
        for line in sys.stdin:
            if line.strip() != "cycle":
                continue
            t0 = time.monotonic()
            print(f"{time.strftime('%H:%M:%S')} cycle: restore", file=sys.stderr, flush=True)
            try:
                got = m.restore(None, target)
                step = int(got["step"])
                want = state_of(step, mesh)
                ok = all(np.array_equal(np.asarray(got[k]), np.asarray(want[k]))
                         for k in ("w", "dp"))
                say(restored=step, ok=ok, seconds=time.monotonic() - t0,
                    tiers=sorted(set(m.last_restore_tiers.values())))
            except MtcError as e:
                step = max([-1, *m.all_steps()])
                say(error=type(e).__name__, message=str(e)[:300],
                    seconds=time.monotonic() - t0)
            try:
                nxt = max([step, *m.all_steps()]) + 1
                for s in (nxt, nxt + 1):
                    print(f"{time.strftime('%H:%M:%S')} save {s}", file=sys.stderr, flush=True)
                    m.save(s, state_of(s, mesh), force=True)
                    m.wait_until_finished()
                say(saved=nxt + 1)
            except MtcError as e:
                say(save_error=type(e).__name__, message=str(e)[:300])
    return 0


class Trainer:
    def __init__(self, base: Path, dispatch: Dispatch) -> None:
        (base / "logs").mkdir(parents=True, exist_ok=True)
        self.log = (base / "logs" / "mtc.trainer.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mtc.trainer.chaos", "--worker", "--base", str(base),
             "--dispatch", dispatch],
            cwd=REPO, env=_env(), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        self._buf = b""
        if self.read(120.0).get("ready") is not True:
            raise RuntimeError("trainer did not start")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float) -> dict[str, Any]:
        """The next JSON line, or {} when none came within ``timeout``. Reads the
        pipe itself: a buffered ``readline`` after ``select`` would leave a second
        line that arrived with the first unseen until the next write."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                try:
                    return dict(json.loads(line))
                except ValueError:
                    continue
            left = deadline - time.monotonic()
            if left <= 0:
                return {}
            r, _, _ = select.select([fd], [], [], min(left, 0.5))
            if r:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return {"exited": True}
                self._buf += chunk

    def kill(self, *, stacks: bool = False) -> None:
        if stacks and self.proc.poll() is None:  # a hung trainer: its threads to the log
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


# -- faults -----------------------------------------------------------------------------


def damage_on_host(cluster: LocalCluster, host: int, how: str, seed: int) -> str | None:
    """Damage a shard of the newest committed step on ``host``'s RAM disk, from a
    process inside the host (only its processes see it). Returns the file's path,
    or None when the host holds no step."""
    h = cluster.hosts.hosts[host]
    r = subprocess.run(h.wrap([sys.executable, "-m", "mtc.trainer.chaos", "--damage",
                               str(h.root), "--how", how, "--seed", str(seed)]),
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"damaging a shard on host {host}: {r.stderr[-1000:]}")
    return r.stdout.strip() or None


def damage_newest(root: Path, how: str, seed: int) -> Path | None:
    """(On the host.) A random shard file of the newest committed step, damaged."""
    rng = random.Random(seed)
    steps = sorted(int(n) for n in os.listdir(root) if n.isdigit()) if root.is_dir() else []
    if not steps:
        return None
    files = sorted(p for p in (root / str(steps[-1])).iterdir() if p.name != "manifest.json")
    if not files:
        return None
    victim = rng.choice(files)
    damage(victim, how)
    return victim


def damage(path: Path, how: str) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        if how == "truncate":
            f.truncate(st.st_size // 2)
        else:
            f.seek(st.st_size // 2)
            b = f.read(1)[0]
            f.seek(st.st_size // 2)
            f.write(bytes([b ^ 0x04]))
    if how == "silent_bit_flip":
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def replicated_everywhere(cluster: LocalCluster) -> int:
    """Newest step every host committed and its peer holds (-1: none)."""
    from mtc.testing import replicas

    n, per = cluster.num_hosts, cluster.hosts_per_slice
    copies: set[replicas.Copy] = set()
    for r, a in enumerate(cluster.addresses):
        got = replicas.held(a, r, cluster.token())
        if got is None:
            return -1
        copies |= {(r, o, s) for o, s in got}
    steps = {s for h, o, s in copies if h == o == 0}
    good = [s for s in steps if all((o, o, s) in copies for o in range(n))
            and not replicas.unreplicated(copies, s, n, per)]
    return max(good, default=-1)


def newest_replicated(cluster: LocalCluster, step: int, timeout: float) -> int:
    """:func:`replicated_everywhere` once it reaches ``step``, or what it is after
    ``timeout`` seconds (a fault may have kept ``step`` from its peer): never fails,
    unlike mtc.testing.replicas.wait_replicated."""
    deadline = time.monotonic() + timeout
    got = -1
    while time.monotonic() < deadline:
        got = replicated_everywhere(cluster)
        if got >= step:
            break
        time.sleep(0.1)
    return got


# -- network faults (isolated hosts only: mtc.trainer.chaos_net) ----------------------


def fault_kinds(net: Network | None) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The faults a run draws from, and their weights: network faults only on
    isolated hosts (so a run without them draws as it always did)."""
    if net is None:
        return FAULTS, WEIGHTS
    return FAULTS + NET_FAULTS, WEIGHTS + NET_WEIGHTS


# -- the driver -------------------------------------------------------------------------


def run(cycles: int, seconds: float, seed: int, base: Path,
        keep_logs: Path | None = None, dispatch: Dispatch = "colocated") -> dict[str, Any]:
    rng = random.Random(seed)
    if base.exists():
        shutil.rmtree(base)
    # Colocated: the sidecars run the trainer's programs on their share of its 8 CPU
    # devices, as Pathways' workers do.
    cluster = LocalCluster.up(base, slices=2, hosts_per_slice=2,
                              colocated_devices=TRAINER_DEVICES if dispatch == "colocated"
                              else 0)
    cluster.poll_seconds = 0.05
    net = network_of(cluster)
    kinds, weights = fault_kinds(net)
    slices = [cluster.hosts_of_slice(s) for s in range(cluster.slices)]
    out: dict[str, Any] = {"cycles": 0, "ok": 0, "corrupt": 0, "divergent": 0, "stale": 0,
                           "errors": Counter(), "hangs": 0, "faults": Counter()}
    seconds_list: list[float] = []
    trainer = Trainer(base, dispatch)
    start = time.monotonic()
    try:
        trainer.send("cycle")  # the first cycle saves steps 0 and 1 from nothing
        trainer.read(CYCLE_DEADLINE_S)
        last_saved = int(trainer.read(CYCLE_DEADLINE_S).get("saved", 0))
        while out["cycles"] < cycles and time.monotonic() - start < seconds:
            # The newest step every host committed and its peer holds: what a
            # one-host fault must not lose.
            expected = newest_replicated(cluster, last_saved, 15.0)
            fault = rng.choices(kinds, weights)[0]
            out["faults"][fault] += 1
            host = rng.randrange(cluster.num_hosts)
            nf = plan_net_fault(fault, host, slices, rng) if fault in NET_FAULTS else None
            if net is not None and nf is not None and not nf.during_restore:
                cut(net, nf)
            if fault == "kill_replicator":
                cluster.kill(host)
                cluster.launch(host)
                cluster.wait_serving(host)
            elif fault == "kill_sidecar":
                cluster.hosts.kill_sidecar(host)
                cluster.start_sidecar(host)
                cluster.save()
            elif fault == "wipe_host":
                cluster.lose_host(host)
                cluster.restart_host(host)
            elif fault in ("bit_flip", "silent_bit_flip", "truncate"):
                damage_on_host(cluster, host, fault, rng.randrange(1 << 30))
            trainer.send("cycle")
            if fault == "kill_trainer":
                time.sleep(rng.uniform(0.0, 1.5))  # mid-restore or mid-save
                trainer.kill()
                trainer = Trainer(base, dispatch)
                trainer.send("cycle")
            elif fault == "kill_replicator_in_restore":
                time.sleep(rng.uniform(0.0, 0.3))
                cluster.kill(host)
                cluster.launch(host)
                cluster.wait_serving(host)
            elif net is not None and nf is not None:
                # The restore runs meanwhile (the trainer's own thread): cut now, or a
                # moment after it began, and heal while it waits.
                if nf.during_restore:
                    time.sleep(nf.start_delay_s)
                    cut(net, nf)
                time.sleep(nf.heal_after_s)
                net.heal()
            out["cycles"] += 1
            reply = trainer.read(CYCLE_DEADLINE_S)
            if not reply or reply.get("exited"):
                if reply.get("exited"):
                    out["errors"]["TrainerExited"] += 1
                else:
                    out["hangs"] += 1
                print(f"cycle {out['cycles']} ({fault} host {host}): restore "
                      f"{'exited' if reply else 'hung'}", file=sys.stderr)
                trainer.kill(stacks=True)
                trainer = Trainer(base, dispatch)
                continue
            if "error" in reply:
                kind = reply["error"]
                if "disagree" in reply.get("message", ""):
                    out["divergent"] += 1
                out["errors"][kind] += 1
                print(f"cycle {out['cycles']} ({fault}): {kind}: {reply['message']}",
                      file=sys.stderr)
            else:
                seconds_list.append(float(reply["seconds"]))
                if not reply["ok"]:
                    out["corrupt"] += 1
                elif fault != "kill_trainer" and reply["restored"] < expected:
                    out["stale"] += 1
                    print(f"cycle {out['cycles']} ({fault}): restored {reply['restored']}, "
                          f"step {expected} was replicated", file=sys.stderr)
                else:
                    out["ok"] += 1
            saved = trainer.read(CYCLE_DEADLINE_S)  # the two saves
            last_saved = int(saved.get("saved", last_saved))
            if "save_error" in saved:
                print(f"cycle {out['cycles']} ({fault} host {host}): save failed: "
                      f"{saved['save_error']}: {saved['message']}", file=sys.stderr)
            if not saved:
                out["hangs"] += 1
                print(f"cycle {out['cycles']} ({fault} host {host}): save hung",
                      file=sys.stderr)
                trainer.kill(stacks=True)
                trainer = Trainer(base, dispatch)
    finally:
        if net is not None:
            net.heal()
        trainer.kill()
        if keep_logs is not None:
            shutil.copytree(base / "logs", keep_logs, dirs_exist_ok=True)
            for i in range(cluster.num_hosts):  # the hosts' own logs, outside base/logs
                for what in ("replicator", "sidecar"):
                    if (p := cluster.hosts.log_path(i, what)).exists():
                        shutil.copy(p, keep_logs / f"{what}-{i}.log")
        cluster.down_latest()
    out["errors"] = dict(out["errors"])
    out["faults"] = dict(out["faults"])
    out["restore_s"] = ({"median": round(statistics.median(seconds_list), 3),
                         "max": round(max(seconds_list), 3)} if seconds_list else None)
    out["seconds"] = round(time.monotonic() - start, 1)
    out["isolation"] = cluster.isolation
    out["dispatch"] = dispatch
    if net is None:
        out["not_injected"] = ["link cuts and partitions (they need network namespaces: "
                               "root)"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mtc.trainer.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=200)
    p.add_argument("--seconds", type=float, default=600.0, help="stop after this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base", type=Path,
                   help="cluster folder (default /dev/shm/mtc-cluster-chaos-<pid>)")
    p.add_argument("--keep-logs", type=Path,
                   help="copy the cluster's logs (the trainer's, each host's replicator's "
                        "and sidecar's) here at the end")
    p.add_argument("--dispatch", choices=("colocated", "process"), default="colocated",
                   help="how the trainer reaches the hosts: colocated Python (Pathways, the "
                        "default) or seam requests to their sidecars")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--damage", type=Path, help=argparse.SUPPRESS)  # a RAM disk, on its host
    p.add_argument("--how", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.base, args.dispatch)
    if args.damage:
        victim = damage_newest(args.damage, args.how, args.seed)
        print(victim or "")
        return 0
    # SIGTERM (a timeout, a CI's cancel) unwinds like Ctrl-C: run()'s clean-up ends
    # the cluster it started, which would otherwise outlive the driver (its hosts
    # run in sessions of their own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    base = args.base or default_base(f"chaos-{os.getpid()}")
    print(json.dumps(run(args.cycles, args.seconds, args.seed, base, args.keep_logs,
                         args.dispatch)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
