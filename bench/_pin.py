"""Pinning processes to cores, as on a real host: a TPU host's CPUs are not its
accelerators, so the threads that run the trainer's CPU devices' programs
(standing in for accelerators here) get a core of their own, and what runs on a
real job's CPUs the others: the hosts' sidecars and replicators, the trainer's
compiles.

A process is started on given cores (:func:`pinning`, a ``preexec``: its threads
and children inherit them); :class:`Pinner` moves threads by name (the trainer's
:data:`DEVICE_THREADS` onto the devices' core) or whole processes (the hosts'):
every matching thread of every process ``pids()`` names, again every ``period_s``
(a replaced host is a new process; a new thread inherits its creator's cores).
Given a ``nice``, it also lowers the priority of those processes (:func:`lower`):
on the hosts' cores the trainer's loop, which a real job runs elsewhere (on
Pathways, on the controller), goes before them. Whoever enters it joins its
thread on exit."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from pathlib import Path

from bench._cpu import Periodic

# The OS names of the threads in which XLA's CPU client runs a device's program
# (its executor and its intra-op pool): with CPU devices standing in for accelerators,
# these are the accelerators' work. A JAX whose client names them otherwise leaves
# them unmoved, which the bench refuses (``Pinner.moved``).
DEVICE_THREADS = frozenset({"tf_XLAExecute", "tf_XLAEigen"})


def pinning(cores: set[int]) -> Callable[[], None]:
    """A ``preexec_fn`` that pins the child (and so everything it starts) to ``cores``."""
    def pin() -> None:
        os.sched_setaffinity(0, cores)
    return pin


def pin_process(pid: int, cores: set[int], named: Collection[str] | None = None) -> int:
    """Pin every thread of ``pid`` (only those whose OS name is in ``named``, if
    given) to ``cores``; returns how many were moved."""
    moved = 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0  # gone
    for tid in tids:
        try:
            if named is not None:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    if f.read().strip() not in named:
                        continue
            if os.sched_getaffinity(tid) != cores:
                os.sched_setaffinity(tid, cores)
                moved += 1
        except OSError:
            pass  # the thread ended meanwhile
    return moved


# Where this process's scheduling group shows (a module attribute: a test stands in).
SELF_GROUP = Path("/proc/self/autogroup")


def _group(path: Path) -> tuple[str, int] | None:
    """A process's autogroup, "/autogroup-123 nice 0", as (name, nice); None where
    the file reads empty: the process is in the kernel's root group, not one of its
    session's own (CI's runner is; the hosts it starts lead their own sessions)."""
    text = path.read_text()
    if not text.strip():
        return None
    name, nice = text.split("nice")
    return name.strip(), int(nice)


def lower(pid: int, nice: int) -> bool:
    """Every thread of ``pid`` at ``nice``, and so is the process's scheduling group
    (its autogroup: one per session; the local cluster's host processes start
    their own) unless it is this process's (whose children, the trainer among
    them, share it): between groups the kernel shares a core by the groups' nice,
    whatever their threads'. Returns whether the group's is set (or there is none
    to set); False: to try again (without CAP_SYS_ADMIN the kernel takes one
    change of any autogroup's nice per tenth of a second, machine-wide)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return True  # gone
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass  # the thread ended meanwhile
    try:
        group = Path(f"/proc/{pid}/autogroup")
        theirs = _group(group)
        if theirs is None:
            return True  # the root group: no group of its own to set
        ours = _group(SELF_GROUP)
        if ours is not None and theirs[0] == ours[0]:
            return True  # this process's group, and the trainer's: not to slow
        if theirs[1] != nice:
            group.write_text(str(nice))
    except FileNotFoundError:
        return True  # no autogroups in this kernel, or the process is gone
    except (OSError, ValueError):
        return False
    return True


class Pinner(Periodic):
    """Keeps the processes ``pids()`` names (only their threads whose OS name is in
    ``named``, if given) on ``cores``, and (``nice``) at that nice."""

    def __init__(self, pids: Callable[[], list[int]], cores: set[int],
                 period_s: float = 0.5, named: Collection[str] | None = None,
                 nice: int | None = None) -> None:
        super().__init__("pinner", period_s)
        self._pids = pids
        self.cores = cores
        self.named = named
        self.nice = nice
        self.moved = 0

    def tick(self) -> None:
        try:
            for pid in self._pids():
                self.moved += pin_process(pid, self.cores, self.named)
                if self.nice is not None:
                    # Every time, as the pinning: threads started since, and a
                    # group's change the kernel's rate limit refused.
                    lower(pid, self.nice)
        except (OSError, ValueError, KeyError):
            pass  # the cluster's state file is being replaced: next time
