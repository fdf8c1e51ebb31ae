"""Phases of a multi-controller job that comes back after a failure, driven by
tests/test_multicontroller_restarts.py: the job, state and checks of
``mc_worker.py``, each process alone on its host. ``--steps`` names the steps.

- ``kill`` (``--steps 20,25``): saves both; the last host's process is SIGKILLed
  after ``save(25)`` returned and before its host committed step 25 (its commit
  is held back in this process, so the kill lands first, every time); the other
  hosts commit it. Host 1 keeps a copy of its step 25 aside (``kept-25``), which
  ``resume`` plants back.
- ``resume`` (``--steps 20,25``): the replicators agree on 20 and fence 25 off on
  every host and in every replicator's copies; the job restores 20, saves 25 again
  with other data (seed 1), and its next start restores that 25 exactly. Then
  host 1's copy of the first run's 25 is put back (nothing fences a step the test
  plants): restoring 25 is ``MixedRunError`` on every process, never a mix; saved
  again (seed 2), 25 is replaced on every host and restores exactly.
- ``lost``: a host and its peer were wiped, there is no backup: ``latest_step()``
  and ``restore()`` raise ``DataLossError`` on every process, naming the ranks
  and steps, never None.
- ``grow`` (``--steps 4``): a job that ran on 2 of the 4 hosts comes back on all
  4: the step the smaller job saved restores exactly everywhere (the hosts that
  did not save it read their regions from the others' copies, through the
  replicators); then it saves the next step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from mc_worker import RESULT_PREFIX, Worker, main


class Restarts(Worker):
    PHASES = ("kill", "resume", "lost", "grow")
    RECOVERABLE = ("kill",)

    def steps(self) -> list[int]:
        return [int(s) for s in self.args.steps.split(",") if s]

    def own_steps(self) -> list[int]:
        root = Path(self.args.local_dir)
        return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())

    def copies_held(self, step: int) -> list[list[int]]:
        """(holder, origin) of the copies of ``step`` this host's replicator lists."""
        from mtc.credentials import Credentials
        from mtc.proto import replicator_pb2 as pb
        from mtc.sidecar.replicator.wire.client import PeerClient

        token = Path(self.args.token_file).read_text().strip()
        rank = self.pid
        client = PeerClient(self.args.replicators.split(",")[rank], Credentials(token=token),
                            rank=rank, deadline_s=10.0)
        try:
            inv = client.call("GetInventory", pb.InventoryRequest(without_files=True))
        finally:
            client.close()
        return sorted([rank, c.origin_rank] for c in inv.copies if c.step == step)

    def report(self) -> None:
        print(RESULT_PREFIX + json.dumps(self.summary), flush=True)

    @staticmethod
    def hold_commit(step: int) -> None:
        """This process's host never commits ``step``: its writer waits at the commit
        (until the process is killed)."""
        from mtc.sidecar.save import write

        commit = write.publish

        def held(tmp: Path, final: Path) -> None:
            if final.name == str(step):
                threading.Event().wait()
            commit(tmp, final)

        write.publish = held  # type: ignore[assignment]

    def kill(self) -> None:
        from jax.experimental import multihost_utils

        *before, last = self.steps()
        victim = self.nproc - 1
        root = Path(self.args.local_dir)
        mgr = self.manager()
        for s in before:
            self.check(mgr.save(s, self.state(s)) is True, f"save({s}) returned False")
        mgr.wait_until_finished()
        if self.pid == victim:
            self.hold_commit(last)
        self.check(mgr.save(last, self.state(last)) is True, f"save({last}) returned False")
        if self.pid != victim:
            mgr._dispatch.wait()  # this host's own commit (not collective: one never comes)
            mgr.close()
            if self.pid == 1:
                shutil.copytree(root / str(last), root / f"kept-{last}")
        self.summary["own_steps"] = self.own_steps()
        self.report()
        multihost_utils.sync_global_devices("mc-kill")  # every other host has committed
        if self.pid == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)  # the job is gone with its process: no shutdown barrier

    def resume(self) -> None:
        import mtc

        agreed, killed = self.steps()
        mgr = self.manager()
        try:
            latest = mgr.latest_step()
            self.summary["latest_step"] = latest
            self.check(latest == agreed, f"latest_step() {latest}, wanted {agreed}")
            # Fenced off before the answer: on this host's RAM disk and in every
            # copy its replicator holds.
            self.summary["fenced"] = {"own": self.own_steps(), "copies": self.copies_held(killed)}
            self.restore_checked(f"step {agreed}", mgr, agreed, "saved")
            self.check(mgr.save(killed, self.state(killed, seed=1)) is True,
                       f"save({killed}) after the restore returned False")
            mgr.wait_until_finished()
        finally:
            mgr.close()

        mgr = self.manager()  # the next start
        try:
            latest = mgr.latest_step()
            self.summary["resumed_latest"] = latest
            self.check(latest == killed, f"next start: latest_step() {latest}, wanted {killed}")
            self.restore_checked(f"resumed step {killed}", mgr, killed, "saved", seed=1)
        finally:
            mgr.close()

        if self.pid == 1:  # the first run's copy of the step, planted back on host 1
            root = Path(self.args.local_dir)
            shutil.rmtree(root / str(killed))
            os.rename(root / f"kept-{killed}", root / str(killed))
        mgr = self.manager()
        try:
            try:
                mgr.restore(killed, target=self.target_from_structs("saved"))
                self.check(False, f"restore({killed}) of two runs' bytes succeeded")
            except mtc.MtcError as e:
                self.summary["planted"] = type(e).__name__
            # Not one run's on every host: saving it again replaces it everywhere.
            self.check(mgr.save(killed, self.state(killed, seed=2)) is True,
                       f"save({killed}) over the mix returned False")
            mgr.wait_until_finished()
            self.restore_checked(f"step {killed} saved over the mix", mgr, killed, "saved",
                                 seed=2)
        finally:
            mgr.close()

    def lost(self) -> None:
        import mtc

        mgr = self.manager()
        try:
            calls: dict[str, Any] = {
                "latest_step": mgr.latest_step,
                "restore": lambda: mgr.restore(target=self.target_from_structs("saved"))}
            for name, call in calls.items():
                try:
                    got = call()
                    self.check(False, f"{name}() answered {got!r:.100} with data lost")
                except mtc.MtcError as e:
                    self.summary[name] = [type(e).__name__, str(e)]
        finally:
            mgr.close()

    def grow(self) -> None:
        (step,) = self.steps()
        mgr = self.manager()
        try:
            latest = mgr.latest_step()
            self.summary["latest_step"] = latest
            self.check(latest == step, f"latest_step() {latest} on the grown job, wanted {step}")
            self.restore_checked(f"step {step} on the grown job", mgr, step, "saved")
            self.summary["tiers"] = {str(h): t for h, t in mgr.last_restore_tiers.items()}
            self.fetched(mgr)
            self.check(mgr.save(step + 1, self.state(step + 1)) is True,
                       f"save({step + 1}) returned False")
            mgr.wait_until_finished()
        finally:
            mgr.close()


if __name__ == "__main__":
    sys.exit(main(Restarts))
