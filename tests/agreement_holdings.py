"""Members' holdings as the agreement tests write them (``tests/test_agreement.py``
and ``tests/test_agreement_coordinator.py``): the equivalence of a rank's data
(its own only, or a peer group of two), and :class:`Holding` builders: copies and
backups, copies with the steps a job saved, copies with their runs, and copies of
a job that saved on other ranks."""

from __future__ import annotations

from mtc.sidecar.replicator.agree.decision import Holding


def own_only(r: int) -> list[int]:
    return [r]


def peer_group_of_2(r: int) -> list[int]:  # 2 slices of 1 host: Orbax's equivalence
    return [0, 1]


def h(*copies: tuple[int, int], backed: tuple[int, ...] = ()) -> Holding:
    return Holding(frozenset(copies), frozenset(backed))


def hs(*copies: tuple[int, int], saved: tuple[tuple[int, int], ...] = ()) -> Holding:
    return Holding(frozenset(copies), frozenset(), None, frozenset(saved))


def hr(*copies: tuple[int, int, str, int]) -> Holding:
    """A member's copies with their runs: (origin, step, run, hosts that saved it)."""
    return Holding(frozenset((o, s) for o, s, _, _ in copies), frozenset(), None, frozenset(),
                   frozenset(copies))


def hk(*copies: tuple[int, int, str, tuple[int, ...]]) -> Holding:
    """Copies of a job that saved on ranks other than 0..n-1: (origin, step, run, ranks)."""
    return Holding(frozenset((o, s) for o, s, _, _ in copies), frozenset(), None, frozenset(),
                   frozenset((o, s, r, len(k)) for o, s, r, k in copies),
                   frozenset((s, r, k) for _, s, r, k in copies))
