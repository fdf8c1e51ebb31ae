"""Ports the local cluster and the tests hand to servers: never in the ephemeral range,
so no outgoing connection takes one between the pick and a (re)start that binds it."""

from __future__ import annotations

import socket

import pytest

from mtc import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    picked = ports.free_ports(50)
    assert len(set(picked)) == 50
    ceiling = ports._ceiling()
    assert all(ports._FLOOR <= p < ceiling for p in picked), (picked, ceiling)
    for p in picked[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_handed_out_and_none_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # something else listens on a port we then make the range
        s.bind(("127.0.0.1", 0))
        s.listen()
        held = s.getsockname()[1]
        monkeypatch.setattr(ports, "_FLOOR", held - 3)
        monkeypatch.setattr(ports, "_ceiling", lambda: held + 4)
        ports._given.difference_update({("127.0.0.1", p) for p in range(held - 3, held + 4)})
        free = {p for p in range(held - 3, held + 4)
                if p != held and ports._bindable("127.0.0.1", p)}
        picked = ports.free_ports(len(free))
        assert set(picked) == free  # every free one, the held one never
        with pytest.raises(OSError, match="no free port"):
            ports.free_ports(1)  # none twice: the range is used up
