"""The replicator's fence, as pure functions (tabled in ``tests/test_replicator_fence.py``).

After the members agree to restore step S (``agree/decision.py``: the newest step
complete among the members), each node deletes every copy it holds of a step newer
than S, its own steps and its peers' alike, whichever run wrote them; a copy of
such a step that was on its way when the fence came is refused at its commit.

Where it applies: :meth:`LocalStore.fence <.store.LocalStore.fence>` deletes what
:func:`to_fence` names, once per decision read (:func:`fences_on`, from
``agree/node_agreement.py``); an incoming copy's commit asks
:meth:`LocalStore.fenced_since <.store.LocalStore.fenced_since>`, which is
:func:`refused_at_commit` over the fences since its offer.

It differs from the controller's rule (:mod:`mtc.fencing`), which keeps a newer
step every host committed and copies whose run it cannot read. Why each is the
safe one where it runs: ``docs/agreement.md`` ("Steps newer than the agreed one
are fenced off"); ``tests/test_replicator_fence.py`` tables the cases where they
differ.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def fences_on(decided: int, fresh: bool) -> bool:
    """Whether reading a decision of step ``decided`` fences: only a new decision
    (``fresh``: not one already read, asked again) of a step (-1: nothing
    restorable, nothing to keep apart)."""
    return decided >= 0 and fresh


def to_fence(agreed: int, held: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The copies (origin, step) of ``held`` that a fence at ``agreed`` deletes:
    every one of a step newer than ``agreed``."""
    return sorted({(o, s) for o, s in held if s > agreed})


def refused_at_commit(step: int, fenced_since: Sequence[int] | None) -> bool:
    """Whether an incoming copy of ``step`` is refused at its commit, given the
    steps of the fences made since it was offered (in order; None: more fences
    than remembered, so unknown). Any fence below ``step`` since the offer deleted
    that step's copies here: the copy on its way is of the bytes it deleted, and
    must not come back behind it. When unsure, refused (the origin offers again)."""
    if fenced_since is None:
        return True
    return any(step > f for f in fenced_since)
