"""mtc.dispatch.calls' pure policy: when a call between saves polls the hosts."""

from __future__ import annotations

import pytest

from mtc.dispatch.calls import POLL_INTERVAL_S, poll_due


@pytest.mark.parametrize(("in_flight", "since", "due"), [
    (False, 10 * POLL_INTERVAL_S, False),  # nothing in flight: nothing left to raise
    (True, 0.0, False),  # just polled
    (True, POLL_INTERVAL_S / 2, False),  # within the interval: no round trip per step
    (True, POLL_INTERVAL_S, True),  # the interval has passed
    (True, 10 * POLL_INTERVAL_S, True),
])
def test_a_save_in_flight_is_polled_at_most_every_interval(in_flight: bool, since: float,
                                                          due: bool) -> None:
    assert poll_due(in_flight, 100.0, 100.0 + since) is due
