"""A manager nobody closed: its saves are finished when it is collected, never on the
thread that dropped it (which may be one its saves need)."""

from __future__ import annotations

import gc
import threading

from mtc import lifecycle


class Owner:
    pass


class Dispatch:
    """Stands in for a manager's dispatcher (the lifecycle asks only wait and close)."""

    def __init__(self, writer: threading.Thread) -> None:
        self.writer = writer
        self.waited_on: threading.Thread | None = None
        self.closed = False

    def wait(self) -> None:
        self.waited_on = threading.current_thread()
        # A writer thread waiting for its own saves would never return.
        assert self.waited_on is not self.writer, "waited for its saves on its own writer"

    def close(self) -> None:
        self.closed = True


def test_a_manager_collected_on_its_own_writer_thread_is_finished_on_another() -> None:
    box: list[Owner] = [Owner()]
    dispatch: list[Dispatch] = []

    def writer() -> None:  # the last reference goes on the manager's writer thread
        dispatch.append(Dispatch(threading.current_thread()))
        lifecycle.track(box[0], lifecycle.Held(dispatch[0], "ckpt"))
        box.clear()
        gc.collect()

    t = threading.Thread(target=writer)
    t.start()
    t.join(10)
    assert lifecycle.join_finishing(10)
    d = dispatch[0]
    assert d.closed and d.waited_on is not None and d.waited_on is not d.writer


def test_a_released_manager_is_not_finished_again() -> None:
    owner = Owner()
    d = Dispatch(threading.current_thread())
    held = lifecycle.Held(d, "ckpt")
    lifecycle.track(owner, held)
    held.release()
    assert d.closed
    d.closed = False
    del owner
    gc.collect()
    assert lifecycle.join_finishing(10)
    assert not d.closed and d.waited_on is None
