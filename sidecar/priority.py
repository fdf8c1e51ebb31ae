"""The CPU share of a host-side process's background work, against the job's.

A thread's nice value orders threads within their scheduling group only. Where
Linux groups each session's processes (autogroup, on by default on desktops
and on these machines) a host process started in a session of its own (the
local cluster starts each replicator so, as a container runtime puts each
container in a cgroup of its own) competes with the job's processes as one
group, whatever its threads' nice: its niced background threads take as much of
the cores as the job's busy threads do. The group's own nice is what yields.

On a real cluster each container is its own cgroup, which autogroup does not
touch: there the replicator's CPU share is its container's ``resources``
(deploy/), and everything here changes nothing (the kernel keeps autogroups for
tasks of the root cgroup only).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

AUTOGROUP = Path("/proc/self/autogroup")
# Without CAP_SYS_ADMIN the kernel takes one change of any autogroup's nice per
# tenth of a second, machine-wide (EAGAIN otherwise): a change back is retried
# this many times, this far apart.
_RETRIES = 20
_RETRY_S = 0.06


def autogroup_nice() -> int | None:
    """This process's scheduling group's nice; None where the kernel has no
    autogroups (or does not show this process's)."""
    try:
        # "/autogroup-123 nice 0"
        return int(AUTOGROUP.read_text().split("nice")[1])
    except (OSError, IndexError, ValueError):
        return None


def set_autogroup_nice(nice: int, *, retries: int = 0) -> bool:
    """Sets this process's scheduling group's nice (0 to 19: lowering it below 0
    takes a privilege), retried ``retries`` times while the kernel's rate limit
    refuses; whether it was set."""
    for attempt in range(retries + 1):
        try:
            AUTOGROUP.write_text(str(max(0, min(19, nice))))
            return True
        except OSError as e:
            if e.errno != errno.EAGAIN or attempt == retries:
                return False
            time.sleep(_RETRY_S)
    return False


def _own_group_nice() -> int | None:
    """This process's group's nice where the group is this process's alone to
    change: it leads its own session. Another's group (a user's shell, with the
    trainer started from it) holds processes that are not this one's to slow,
    and there a process's and its threads' nice already order it against them."""
    return autogroup_nice() if os.getsid(0) == os.getpid() else None


def lower_group_priority(by: int) -> None:
    """This process's group's nice raised by ``by`` for good (``--nice``), where
    the group is its own; the process's own nice is the caller's (its threads
    inherit it)."""
    current = _own_group_nice()
    if current is not None:
        set_autogroup_nice(current + by)


@contextlib.contextmanager
def group_yields(nice: int = 19) -> Iterator[bool]:
    """While the block runs, this process's group yields the cores to the job's
    (its nice at least ``nice``), then gets its own nice back; yields whether the
    group's nice was changed (only where the group is the process's own)."""
    old = _own_group_nice()
    changed = old is not None and old < nice and set_autogroup_nice(nice)
    try:
        yield changed
    finally:
        if changed and old is not None and not set_autogroup_nice(old, retries=_RETRIES):
            log.warning("could not give this process's scheduling group its nice %d back: "
                        "its work yields to the job's until it is", old)
