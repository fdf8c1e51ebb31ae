"""mtc.trainer.replicated: which copies make a step replicated, and the bounded wait
on them (``held`` here is a list of answers, as the harnesses' inventories give)."""

from __future__ import annotations

import pytest

from mtc.trainer.replicated import peer_copies, wait_replicated


@pytest.mark.parametrize(("hosts", "per_slice", "want"), [
    (2, 1, {(1, 0, 7), (0, 1, 7)}),
    (4, 2, {(2, 0, 7), (3, 1, 7), (0, 2, 7), (1, 3, 7)}),
    (6, 3, {(3, 0, 7), (4, 1, 7), (5, 2, 7), (0, 3, 7), (1, 4, 7), (2, 5, 7)}),
])
def test_each_hosts_copy_is_on_the_host_a_slice_on(hosts: int, per_slice: int,
                                                   want: set[tuple[int, int, int]]) -> None:
    assert peer_copies(7, hosts, per_slice) == want


def test_the_wait_ends_once_every_copy_is_held() -> None:
    answers: list[set[tuple[int, int, int]]] = [
        set(), {(1, 0, 7)}, {(1, 0, 7), (0, 1, 7), (0, 1, 6)}]
    asked: list[int] = []

    def held() -> set[tuple[int, int, int]]:
        asked.append(1)
        return answers[min(len(asked), len(answers)) - 1]

    assert wait_replicated(held, 7, 2, 1, timeout=5.0, poll_s=0.001) >= 0
    assert len(asked) == 3  # not before the last copy came


def test_a_copy_that_never_comes_is_named_after_the_timeout() -> None:
    with pytest.raises(TimeoutError, match=r"step 7 not replicated .*\[\(0, 1, 7\)\]"):
        wait_replicated(lambda: {(1, 0, 7), (0, 1, 6)}, 7, 2, 1, timeout=0.05, poll_s=0.01)
