"""Reused slots of a host's area for colocated calls (mtc.slots): both halves, as
the controller's runtime and a sidecar use them, through pack/unpack_message."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from mtc import transfer
from mtc.errors import ProtocolError
from mtc.slots import SlotMaps, SlotPool

SIZE = transfer.INLINE_LIMIT + 3 * transfer.ALIGN  # large enough to leave the message


def _call(area: Path, pool: SlotPool, maps: SlotMaps, fill: int
          ) -> tuple[dict[str, object], list[np.ndarray]]:
    """One call's input through the area: the controller packs, the sidecar unpacks."""
    message = transfer.pack_message(area, {"n": fill}, [np.full(SIZE, fill, np.uint8)], pool)
    return transfer.unpack_message(area, message, maps)


def _reply(pool: SlotPool, maps: SlotMaps) -> None:
    """A reply from the sidecar: its report of the slots, read by the controller."""
    gc.collect()
    pool.update({"boot": maps.boot, "slots": maps.report()})


def _files(area: Path) -> list[str]:
    return sorted(p.name for p in area.iterdir())


def test_steady_state_calls_reuse_one_slot_and_create_no_file(tmp_path: Path) -> None:
    pool, maps = SlotPool(tmp_path), SlotMaps(tmp_path)
    header, bufs = _call(tmp_path, pool, maps, 1)
    assert "slot" in header and "file" not in header
    assert int(bufs[0][0]) == 1 and bufs[0].nbytes == SIZE
    files = _files(tmp_path)
    assert files == [header["slot"]]
    first = header["slot"]
    del bufs  # the write that read them ended
    _reply(pool, maps)
    for fill in range(2, 6):
        header, bufs = _call(tmp_path, pool, maps, fill)
        assert header["slot"] == first  # the same slot, again and again
        assert np.all(bufs[0] == fill)
        assert _files(tmp_path) == files  # no new file in the area per call
        del bufs
        _reply(pool, maps)
    assert pool.busy() == 0


def test_a_slot_still_being_written_is_never_refilled(tmp_path: Path) -> None:
    pool, maps = SlotPool(tmp_path), SlotMaps(tmp_path)
    h1, held1 = _call(tmp_path, pool, maps, 1)  # a save still being written
    _reply(pool, maps)
    h2, held2 = _call(tmp_path, pool, maps, 2)  # the next save: the other slot
    assert h2["slot"] != h1["slot"]
    _reply(pool, maps)
    h3, held3 = _call(tmp_path, pool, maps, 3)  # every slot busy: a fresh file
    assert "slot" not in h3 and "file" in h3
    assert np.all(held1[0] == 1) and np.all(held2[0] == 2)  # nothing overwritten
    assert int(held3[0][0]) == 3
    del held2, held3
    _reply(pool, maps)
    h4, held4 = _call(tmp_path, pool, maps, 4)  # the slot whose write ended
    assert np.all(held4[0] == 4)
    assert h4["slot"] == h2["slot"]
    assert np.all(held1[0] == 1)
    assert pool.busy() == 2


def test_views_of_views_keep_the_slot_busy(tmp_path: Path) -> None:
    """What a program keeps of its input (a typed view of a part, as a shard the
    writer holds) keeps the slot busy as long as the whole buffer would."""
    pool, maps = SlotPool(tmp_path), SlotMaps(tmp_path)
    _, bufs = _call(tmp_path, pool, maps, 7)
    part = bufs[0][transfer.ALIGN:2 * transfer.ALIGN].view(np.float32).reshape(32, 32)
    del bufs
    _reply(pool, maps)
    assert pool.busy() == 1
    del part
    _reply(pool, maps)
    assert pool.busy() == 0


def test_the_sidecar_refuses_a_refill_of_a_held_slot(tmp_path: Path) -> None:
    """A controller that ignored the report (or a forged message) is refused loudly."""
    pool, maps = SlotPool(tmp_path), SlotMaps(tmp_path)
    header, held = _call(tmp_path, pool, maps, 1)
    with pytest.raises(ProtocolError, match="still held"):
        maps.view(str(header["slot"]), int(str(header["use"])) + 1, SIZE)
    with pytest.raises(ProtocolError, match="bad slot"):
        maps.view("../ramdisk/1", 1, SIZE)
    assert np.all(held[0] == 1)


def test_a_stale_or_foreign_report_frees_nothing(tmp_path: Path) -> None:
    pool, maps = SlotPool(tmp_path), SlotMaps(tmp_path)
    header, held = _call(tmp_path, pool, maps, 1)
    name = str(header["slot"])
    pool.update({"boot": maps.boot, "slots": {name: [int(str(header["use"])) - 1, False]}})
    pool.update({"boot": maps.boot, "slots": {}})  # the same sidecar, not seen yet
    assert pool.busy() == 1
    # A restarted sidecar (new boot) that never saw the use: its holder is gone.
    pool.update({"boot": "another", "slots": {}})
    assert pool.busy() == 0
    del held


def test_close_removes_the_slots(tmp_path: Path) -> None:
    pool, maps = SlotPool(tmp_path), SlotMaps(tmp_path)
    _, held = _call(tmp_path, pool, maps, 1)
    del held
    maps.drop(pool.names)
    pool.close()
    assert _files(tmp_path) == []
    assert maps.report() == {}
    assert pool.take() is None  # a closed pool fills nothing


def test_a_hosts_reply_pool_is_named_by_a_well_formed_report_only() -> None:
    from mtc.sidecar.host.colocated import _boot_of

    assert _boot_of(None) is None and _boot_of({"slots": {}}) is None
    assert _boot_of({"boot": "ab" * 16, "slots": {}}) == "ab" * 16
    for bad in ("../x", "AB" * 16, 7, "a" * 33):
        with pytest.raises(ProtocolError, match="reply-slot report"):
            _boot_of({"boot": bad})


def test_reply_slots_are_named_apart_and_a_restarted_writers_are_forgotten(
        tmp_path: Path) -> None:
    """A host's reply slots have names of their own (its successor removes its
    predecessor's by name); the reading side accepts only its kind, and forgets
    a restarted writer's slots: at once those no view holds, the others with
    their last view."""
    from mtc.slots import REPLY_PREFIX

    pool = SlotPool(tmp_path, prefix=REPLY_PREFIX)
    maps = SlotMaps(tmp_path, prefix=REPLY_PREFIX)
    header, held = _call(tmp_path, pool, maps, 3)
    assert str(header["slot"]).startswith(REPLY_PREFIX)
    with pytest.raises(ProtocolError, match="bad slot"):  # not an input slot's reader
        _call(tmp_path, pool, SlotMaps(tmp_path), 4)
    pool2 = SlotPool(tmp_path, prefix=REPLY_PREFIX)  # a restarted host's pool
    _, idle = _call(tmp_path, pool2, maps, 5)
    del idle
    gc.collect()
    maps.forget_all()
    assert maps.report() == {header["slot"]: [1, True]}  # the held one stays mapped
    assert np.all(held[0] == 3)
    del held
    gc.collect()
    assert maps.report() == {}  # and goes with its last view
