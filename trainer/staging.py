"""The elastic demo's faults, staged at chosen points of its training loop.

A host is lost right after a save (once the save reached its peer, or while it
is written: ``--host-loss-when``), before the next step is dispatched, so that
step is the one in flight the loss interrupts; a slice is lost while a step runs,
once what the resize needs is compiled ahead. :class:`HostFaults` does the
losing (real SIGKILLs, devices failed in pathwaysutils' simulator); this module
decides when, says which recovery each fault starts, and keeps which devices
lost their part of the newest in-memory snapshot since it was taken.
"""

from __future__ import annotations

import argparse
import time

from pathwaysutils.elastic import elastic as pw_elastic
from pathwaysutils.elastic import manager as pw_manager

from mtc.elastic import compile_ahead as aot
from mtc.trainer.faults import HostFaults
from mtc.trainer.jsonlog import JsonLog
from mtc.trainer.meshes import Slices
from mtc.trainer.recovery import Recovery
from mtc.trainer.schedule import FaultSchedule

# How long the last step waits for a slice on its way back (its hosts' processes
# start in seconds; a minute is a replacement that failed, and the run ends resized).
RETURN_WAIT_S = 60.0


class StagedFaults:
    """The demo loop's fault points: whether a host or a slice is lost at this step
    (by the schedule), losing it through :class:`HostFaults`, the recovery each
    loss starts, a lost slice's return, and the devices that lost their part of
    the newest in-memory snapshot since it was taken (a recovery resumes from the
    snapshot only where the surviving devices still hold all of it)."""

    def __init__(self, args: argparse.Namespace, faults: HostFaults, plan: FaultSchedule,
                 ahead: aot.AheadCompiler | None, jlog: JsonLog) -> None:
        self.args = args
        self.faults = faults
        self.plan = plan
        self.ahead = ahead
        self.log = jlog
        self.snapshot_lost: set[int] = set()  # devices lost since the snapshot was taken
        self.returns_seen = 0  # HostFaults.returns already acted on

    def snapshot_taken(self) -> None:
        self.snapshot_lost = set()

    def host_loss_follows(self, step: int, *, recovering: bool) -> bool:
        """Whether a host is lost after saving ``step`` (the caller knows it saves)."""
        return not recovering and not self.faults.lost_slices \
            and self.plan.host_loss_due(step)

    def lose_host(self, step: int) -> Recovery:
        """Lose ``--lost-host`` after the save of ``step``; the recovery it starts."""
        h = self.args.lost_host
        t, detail = self.faults.lose_host_after_save(h, step, self.args.host_loss_when,
                                                     self.args.host_return_s)
        self.snapshot_lost.update(d.id for d in self.faults.devices_of(h))
        self.plan.host_lost(step)
        self.log.write(event="fault", kind="host_loss", step=step, t=t, **detail)
        return Recovery("host_loss", step, t, detail)

    def slice_loss_due(self, step: int, *, recovering: bool, slices: Slices) -> bool:
        return self.plan.slice_loss_due(step) and not recovering \
            and not self.faults.lost_slices and len(slices) == self.faults.cluster.slices

    def wait_compiled_ahead(self, slices: Slices, timeout: float = 300.0) -> float:
        """Seconds waited until the compile-ahead job for ``slices`` has ended."""
        if self.ahead is None or not slices:
            return 0.0
        t0 = time.perf_counter()
        self.ahead.wait(aot.names([slices])[0], timeout)
        waited = time.perf_counter() - t0
        self.log.write(event="waited_for_compile_ahead", slices=list(slices), seconds=waited)
        return waited

    def lose_slice(self, step: int, waited_for_compile_ahead: float = 0.0) -> Recovery:
        """Lose ``--lost-slice`` while ``step`` runs; the recovery it starts."""
        s = self.args.lost_slice
        hosts = self.faults.cluster.hosts_of_slice(s)
        t = time.time()
        self.plan.slice_lost(s)
        self.faults.lose(hosts, s)
        self.snapshot_lost.update(d.id for h in hosts for d in self.faults.devices_of(h))
        detail = {"slice": s, "hosts": hosts, "in_flight_step": step,
                  "seconds_waited_for_compile_ahead": waited_for_compile_ahead}
        self.log.write(event="fault", kind="slice_loss", step=step - 1, t=t, **detail)
        return Recovery("slice_loss", step - 1, t, detail)

    def wait_for_return(self, slices: Slices) -> None:
        """Before the last step, wait (bounded) for slices on their way back: the run
        ends on every slice it was given back, so the scale-up the fault schedule
        asked for happens however long the replacement's processes take to start
        (seconds on a loaded machine; the loop trains on meanwhile, as a real
        trainer would, and only the last step waits)."""
        on_way = self.faults.replacing_slices() - set(slices)
        if not on_way:
            return
        t0 = time.perf_counter()
        back = self.faults.wait_back(on_way, RETURN_WAIT_S)
        self.log.write(event="waited_for_return", slices=sorted(on_way), back=back,
                       seconds=time.perf_counter() - t0)

    def scale_up_available(self, pw: pw_manager.Manager, slices: Slices) -> bool:
        """Whether inactive slices are healthy again: as pathwaysutils' monitor
        thread found on its last poll, or, as soon as the cluster says lost
        hosts are back, by one health check of the inactive slices right now."""
        if pw.available_inactive_slices:
            return True
        if self.faults.returns == self.returns_seen:
            return False
        self.returns_seen = self.faults.returns
        inactive = {i: pw.slice_to_devices[i]
                    for i in range(self.faults.cluster.slices) if i not in slices}
        found = set(pw_elastic.get_active_slice_indices(inactive)) if inactive else set()
        if found:
            pw.available_inactive_slices = frozenset(found)
        return bool(found)
