"""The one wait of the tests and of mtc.testing (mtc/testing/waits.py)."""

from __future__ import annotations

import itertools

import pytest

from mtc.testing.waits import WaitTimeout, timed_wait, wait_until


def test_the_first_truthy_answer_is_returned_without_waiting_longer() -> None:
    answers = iter([None, 0, "", {"step": 3}, "later"])
    assert wait_until("an answer", lambda: next(answers), 5.0, poll_s=0.001) == {"step": 3}
    assert next(answers) == "later"  # asked no more once it held


def test_a_condition_that_never_holds_names_what_and_what_was_there() -> None:
    asked = itertools.count()
    with pytest.raises(WaitTimeout, match=r"never within 0.05s: step 4 on the peer: it holds "
                                          r"\[1, 2\]") as e:
        wait_until("step 4 on the peer", lambda: next(asked) < 0, 0.05, poll_s=0.005,
                   detail=lambda: "it holds [1, 2]")
    # Both kinds the tests' own loops raised: either ``except`` still catches it.
    assert isinstance(e.value, TimeoutError) and isinstance(e.value, AssertionError)
    assert next(asked) >= 3  # polled meanwhile, and once more at the end


def test_a_condition_met_during_the_last_sleep_counts() -> None:
    calls = itertools.count()
    # False until the deadline has passed (timeout 0): the final ask finds it.
    assert wait_until("the last ask", lambda: next(calls) >= 1, 0.0, poll_s=0.001) is True


def test_during_ends_the_wait_with_its_own_error() -> None:
    def died() -> None:
        raise RuntimeError("replicator 2 exited")

    with pytest.raises(RuntimeError, match="replicator 2 exited"):
        wait_until("replicator 2 serving", lambda: False, 5.0, during=died)


def test_timed_wait_says_how_long_it_waited() -> None:
    answers = iter([False, False, True])
    took = timed_wait("the third ask", lambda: next(answers), 5.0, poll_s=0.01)
    assert 0.02 <= took < 5.0



class _Exits:
    """A process's ``poll`` as :func:`wait_exits` reads it: running until its
    ``after``-th poll, then exited with ``code`` (None: never exits)."""

    def __init__(self, code: int | None, after: int = 0) -> None:
        self.code, self.after, self.polls = code, after, 0
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.polls += 1
        if self.code is not None and self.polls > self.after:
            self.returncode = self.code
        return self.returncode


def test_wait_exits_gives_the_others_a_grace_once_one_fails_and_names_who_failed() -> None:
    import time

    from mtc.testing.waits import wait_exits

    # One fails at once, one is killed on purpose (expected), one would hang: the
    # hung one is left running after the grace, not after the whole bound.
    procs = [_Exits(3), _Exits(-9), _Exits(None)]
    failed: list[int] = []
    t0 = time.monotonic()
    assert wait_exits(procs, 50.0, grace_s=0.05, expected=(1,), failed=failed,  # type: ignore[arg-type]
                      poll_s=0.001) == [2]
    assert time.monotonic() - t0 < 10  # the grace, not the 50 s bound
    assert failed == [0]
    # Killed on purpose alone is no failure: the hung one runs to the bound.
    procs = [_Exits(-9), _Exits(None)]
    t0 = time.monotonic()
    assert wait_exits(procs, 0.2, grace_s=0.0, expected=(0,), poll_s=0.001) == [1]  # type: ignore[arg-type]
    assert time.monotonic() - t0 >= 0.2
    # None fails: every one waited for, nothing left running.
    ok = [_Exits(0), _Exits(0, after=5)]
    assert wait_exits(ok, 30.0, grace_s=0.0, poll_s=0.001) == []  # type: ignore[arg-type]
    assert [p.returncode for p in ok] == [0, 0]
