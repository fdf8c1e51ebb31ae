"""Who saved a step: a claim each saving host makes for itself (issue 66).

Every copy an inventory lists states who saved its step: the saving hosts' ranks
(``saving_ranks``) or their number (``saved_hosts``: hosts 0..n-1). That set
decides a restore: the step needs those ranks' data and no one else's, and a host
left out of it restores the regions of the hosts in it. A rank's certificate
makes that rank's claims only (docs/security.md), so each claim is read as its
origin's word: a copy of rank ``x``'s data is ``x``'s word when proven ``x``'s
(its signed statement includes the saving set: :mod:`..copies.provenance`), and
a host's own entry is its word because it came over a connection that host's
certificate authenticated. A host with its own certificate could list "my own
step 900, saved by me alone" and the job restored it everywhere; or "host 0's data
of step 777 is mine" and a trainer read its bytes as host 0's.

So, under mutual TLS, the saving set of a step (of a run) counts only when:

- every entry of the step that states one states the same set, and every
  origin stating it is in it (a host that says it saved without itself, or two
  hosts that disagree, prove nothing: the step counts for nobody);
- for each host ``m`` that would restore it: ``m`` in the set has said so itself
  (its own entry, or a proven copy of its data); ``m`` left out of it restores
  other hosts' data only on the word of two saving hosts at least (never on one
  host's);
- a trainer's read of saving host ``h``'s data (:func:`origin_of`): every rank in
  the set has said so (the rank named for ``h`` could be the one lying), unless
  the set keeps host ``h``'s data as rank ``h`` (it sends no read elsewhere).

An entry that states no set (an opaque step, Orbax's: every node saved it) claims
nothing: the job's configuration, not a host, says whose data it needs.

Without TLS nothing here applies: a token names nobody and its holder can act as
any rank anyway. Pure functions, tested as tables (``tests/test_attest.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping

from mtc.proto import replicator_pb2 as pb

Saving = tuple[int, ...]


def stated(c: pb.StepCopy) -> Saving | None:
    """The saving set entry ``c`` states: its saving ranks, else hosts 0..n-1 of
    its ``saved_hosts``; None when it states none (an opaque step)."""
    if c.saving_ranks:
        return tuple(c.saving_ranks)
    if c.saved_hosts > 0:
        return tuple(range(c.saved_hosts))
    return None


Said = tuple[int, int, str, Saving]  # (origin, step, run, the saving set it states)


def said_of(copies: Iterable[pb.StepCopy]) -> frozenset[Said]:
    """What ``copies`` (each its origin's word) state of who saved their steps."""
    return frozenset((c.origin_rank, c.step, c.run, s) for c in copies
                     if (s := stated(c)) is not None)


def agreed(said: Mapping[int, set[Saving]]) -> tuple[Saving | None, str]:
    """The one saving set its origins state (``said``: origin -> sets), and ""; or
    None and why there is none."""
    sets = {s for ss in said.values() for s in ss}
    if len(sets) != 1:
        return None, f"the hosts that saved it disagree on who did ({sorted(sets)[:4]})"
    (s,) = sets
    if len(set(s)) != len(s):  # [1, 1]: two saving hosts read as one rank's data
        return None, f"its saving ranks {list(s)[:16]} name a rank twice"
    outside = sorted(o for o in said if o not in s)
    if outside:
        return None, f"rank(s) {outside} say ranks {list(s)} saved it, without themselves"
    return s, ""


def why_not_for(said: Mapping[int, set[Saving]], members: Collection[int]) -> str:
    """Why ``said`` (one step's claims) does not make the step restorable by each of
    ``members``; "" when it does. See the module's doc."""
    s, why = agreed(said)
    if s is None:
        return why
    unsaid = sorted(m for m in members if m in s and m not in said)
    if unsaid:
        return (f"rank(s) {unsaid} never said they saved it (ranks {sorted(said)} say "
                f"ranks {list(s)} did)")
    if len(said) < 2 and any(m not in s for m in members):
        left = sorted(m for m in members if m not in s)
        return (f"only rank(s) {sorted(said)} say ranks {list(s)} saved it: rank(s) "
                f"{left} would restore their data on one host's word")
    return ""


def unattested(said: Iterable[Said], members: Collection[int]
               ) -> dict[tuple[int, str], str]:
    """(step, run) -> why, for each step (of a run) whose saving set, as ``said``
    states it, does not count for ``members`` (:func:`why_not_for`)."""
    by: dict[tuple[int, str], dict[int, set[Saving]]] = defaultdict(lambda: defaultdict(set))
    for origin, step, run, s in said:
        by[(step, run)][origin].add(s)
    return {key: why for key, claims in by.items() if (why := why_not_for(claims, members))}


def origin_of(copies: Iterable[pb.StepCopy], step: int, host: int) -> tuple[int | None, str]:
    """The rank keeping saving host ``host``'s data of ``step``, from the entries
    listed (each its origin's word), and ""; None and why when the entries that state
    a saving set do not all say the same, or some rank in it never said so. No
    entry stating one: host ``h`` is rank ``h``."""
    said: dict[str, dict[int, set[Saving]]] = defaultdict(lambda: defaultdict(set))
    for c in copies:
        s = stated(c)
        if c.step == step and s is not None:
            said[c.run][c.origin_rank].add(s)
    found: set[int] = set()
    for run, by in said.items():
        s, why = agreed(by)
        if s is None:
            return None, f"step {step}{f' (run {run})' if run else ''}: {why}"
        unsaid = sorted(r for r in s if r not in by)
        # Hosts 0..n-1 kept as ranks 0..n-1 point no host's read at another rank.
        if unsaid and s != tuple(range(len(s))):
            return None, (f"step {step}: rank(s) {unsaid} never said ranks {list(s)} saved "
                          f"it (only rank(s) {sorted(by)} say so)")
        if host < len(s):
            found.add(s[host])
    if len(found) > 1:
        return None, f"step {step}: runs disagree on which rank keeps host {host}'s data"
    return (found.pop() if found else host), ""
