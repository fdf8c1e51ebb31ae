"""mtc.lifecycle.SignalStop: a process's graceful stop on SIGTERM/SIGINT, whose
handler takes no lock. A handler that set a threading.Event deadlocked whenever the
signal landed while the main thread held the event's lock inside ``wait`` (a
replicator ignored SIGTERM for 30 s in a CI run): here the signals land at random
points of a loop that spends nearly all its time inside ``wait``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from mtc.lifecycle import SignalStop

CHILD = textwrap.dedent("""
    import os, random, signal, threading, time
    from mtc.lifecycle import SignalStop

    stop = SignalStop(signals=[signal.SIGUSR1], poll_s=0.0005)
    seen = 0
    for i in range(200):
        stop.signalled = None
        stop.event.clear()
        delay = random.random() * 0.002
        # The sender is a plain thread of this child (a test's helper process).
        t = threading.Thread(target=lambda: (time.sleep(delay),
                                             os.kill(os.getpid(), signal.SIGUSR1)))
        t.start()
        deadline = time.monotonic() + 5
        while not stop.wait(0) and time.monotonic() < deadline:
            pass
        t.join()
        seen += stop.is_set() and stop.signalled == signal.SIGUSR1
    print("seen", seen, flush=True)
""")


@pytest.mark.process
def test_signals_landing_anywhere_in_the_wait_stop_it_and_never_deadlock() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["seen", "200"], (out.stdout, out.stderr)


def test_wait_returns_at_its_timeout_and_at_a_set() -> None:
    import signal

    old = signal.getsignal(signal.SIGUSR2)
    try:
        stop = SignalStop(signals=[signal.SIGUSR2], poll_s=0.01)
        assert not stop.wait(0.05) and not stop.is_set()
        stop.set()
        assert stop.wait(10) and stop.is_set() and stop.signalled is None
        again = SignalStop(signals=[signal.SIGUSR2], poll_s=0.01)
        signal.raise_signal(signal.SIGUSR2)
        assert again.wait(None) and again.event.is_set()
        assert again.signalled == signal.SIGUSR2
    finally:
        signal.signal(signal.SIGUSR2, old)
