"""Which committed steps a restore deletes (fencing), as one pure function.

A job that dies between hosts' commits leaves a step on some hosts only. It was
never a checkpoint: no host may restore it, and once the job restarted and
restored an older step it saves that number again, so the dead run's copies
are deleted then (the run identities of :mod:`mtc.runs` already keep two runs'
bytes from ever making one step; fencing frees the room they hold).

The rule (``tests/test_fencing.py`` tables every case):

- a step every host that saved it holds, all of one run, is *complete*: never
  deleted here, whichever run wrote it and however new it is (restoring an
  older step on purpose keeps every newer one, as Orbax does);
- a step no newer than the one restored is left alone (retention's, or the
  user's ``delete``);
- of an incomplete newer step, a host's copy is deleted when a run other than
  this one wrote it (a dead run, or this manager before its last restore); this
  run's own copies stay (a save of this run that failed on some host: the next
  save of that number replaces them), and so does a copy whose run is unknown
  (its manifest could not be read: when unsure, nothing is deleted).

Multi-controller JAX: each process sees its own host only, so whether a step is
complete is learnt collectively and passed in as ``complete``; each process
then deletes its own hosts' copies by the same rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping


@dataclasses.dataclass(frozen=True)
class Fenced:
    """Copies of ``step`` to delete on ``hosts`` (written by ``run``), and why."""

    step: int
    hosts: tuple[int, ...]
    run: str
    why: str


def is_complete(step: int, held: Mapping[int, Collection[int]], saved_hosts: int | None,
                runs: Mapping[int, str]) -> bool:
    """Whether ``step`` is held by every host that saved it (hosts ``0..saved_hosts-1``),
    every copy written by one run (``runs``: host -> run; a host missing there has an
    unreadable manifest). ``saved_hosts`` None: no manifest could say."""
    if saved_hosts is None or saved_hosts <= 0:
        return False
    need = range(saved_hosts)
    if not all(step in held.get(h, ()) for h in need):
        return False
    if not all(h in runs for h in need):
        return False
    return len({runs[h] for h in need}) == 1


def to_fence(restored: int, held: Mapping[int, Collection[int]],
             saved_hosts: Mapping[int, int], runs: Mapping[int, Mapping[int, str]],
             this_run: str, *, complete: Collection[int] | None = None) -> list[Fenced]:
    """The copies a restore of ``restored`` deletes, one :class:`Fenced` per step and run.

    ``held``: each host's committed steps (every host with host subfolders; a
    process's own hosts in multi-controller JAX); ``saved_hosts``: per step, how
    many hosts saved it (its manifests); ``runs``: per step, the run that wrote each
    host's copy (a host absent: its manifest could not be read); ``this_run``: the
    run saving now; ``complete``: the steps complete on every host of the job,
    where this process cannot see every host (multi-controller JAX), else None."""
    out: list[Fenced] = []
    newer = sorted({s for steps in held.values() for s in steps if s > restored})
    for s in newer:
        step_runs = runs.get(s, {})
        whole = (s in complete if complete is not None
                 else is_complete(s, held, saved_hosts.get(s), step_runs))
        if whole:
            continue
        holders = sorted(h for h, steps in held.items() if s in steps)
        by_run: dict[str, list[int]] = {}
        for h in holders:
            run = step_runs.get(h)
            if run is None or run == this_run:
                continue  # unknown (unsure: keep), or this run's own save
            by_run.setdefault(run, []).append(h)
        n = saved_hosts.get(s)
        where = (f"held by hosts {holders} of the {n} that saved it" if complete is None and n
                 else f"held by hosts {holders}, not by every host of the job")
        for run, hosts in sorted(by_run.items()):
            out.append(Fenced(s, tuple(hosts), run,
                              f"{where}: an earlier run ({run or 'unrecorded'}) left it "
                              f"incomplete"))
    return out
