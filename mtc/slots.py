"""Reused slots of a host's shared-memory area for colocated calls' bytes.

A worker takes a save's shards with one device-to-host copy into host buffers
it reuses; on the local cluster a reused slot of the host's area stands in for
those buffers (memory this VM has not touched recently is several times slower
to fill than memory reused, and a fresh file per call pays for it every save).
A restore's arrays come back the other way through slots the host fills.

Two halves, one per side of the area, for either direction:

- :class:`SlotPool` (the side that fills them: the controller for a call's
  inputs, a host's sidecar for its replies): a few slots, each busy from the
  message that fills it until the other side reports that use released. A
  message that finds none free goes through a fresh file: the pool bounds
  memory, never liveness.
- :class:`SlotMaps` (the side that reads them): maps each slot once and hands
  out read-only views of one use of it; the use is busy while anything still
  refers to those views (a program's arrays, the writer's staged shards, a
  restore's arrays adopting the mapping) and released when the last reference
  goes, so a slot is never refilled while anything still reads it. Each message
  back reports each slot's last use and whether it is released, with the
  reader's boot id: a reader that restarted holds nothing of its predecessor's.

Calls to one host are made in order (the colocated dispatcher waits for a call's
answer before the next); a report covers every use sent before it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import threading
import uuid
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from mtc import transfer
from mtc.errors import ProtocolError

# Slots per host: one for the save being written, one for the next save's copy.
SLOTS_PER_HOST = 2
# A call's inputs cross through the controller's slots, a host's replies through
# the host's: told apart by name, so that a restarted sidecar knows which files of
# its area its predecessor left (REPLY_PREFIX) and removes them.
INPUT_PREFIX = "slot-"
REPLY_PREFIX = "out-slot-"
_TAG = r"[0-9a-f]{8}-\d{1,3}"


class CallSlot(transfer.SaveSlot):
    """A slot and its use count: the n-th call that filled it."""

    def __init__(self, area: Path, name: str) -> None:
        super().__init__(area, name)
        self.use = 0


class SlotPool:
    """The slots one side fills (the controller's for one host, or a host's
    replies to one controller). Thread-safe."""

    def __init__(self, area: Path, count: int = SLOTS_PER_HOST, *,
                 prefix: str = INPUT_PREFIX) -> None:
        tag = uuid.uuid4().hex[:8]  # two managers at once never share a slot
        self._slots = [CallSlot(area, f"{prefix}{tag}-{k}") for k in range(count)]
        self._lock = threading.Lock()
        self._boot: str | None = None

    @property
    def names(self) -> list[str]:
        return [s.name for s in self._slots]

    def busy(self) -> int:
        with self._lock:
            return sum(s.busy for s in self._slots)

    def take(self) -> CallSlot | None:
        """A free slot, now busy with a new use; None when every slot is busy."""
        with self._lock:
            slot = next((s for s in self._slots if not s.busy), None)
            if slot is not None:
                slot.busy = True
                slot.use += 1
            return slot

    def unsent(self, slot: CallSlot) -> None:
        """``slot``'s call never reached the host: free again."""
        with self._lock:
            slot.busy = False

    def update(self, header: dict[str, Any]) -> bool:
        """Free the slots the reader's report in ``header`` says released (the use
        sent last); True when the reader restarted since its last report."""
        boot, report = header.get("boot"), header.get("slots")
        if not isinstance(boot, str) or not isinstance(report, dict):
            return False  # a sidecar that keeps no slots
        with self._lock:
            restarted = self._boot is not None and boot != self._boot
            self._boot = boot
            for s in self._slots:
                got = report.get(s.name)
                if got is None:
                    # A new sidecar never received this use; its predecessor, which
                    # did, is gone with its references.
                    if restarted:
                        s.busy = False
                elif int(got[0]) == s.use and not got[1]:
                    s.busy = False
        return restarted

    def close(self) -> None:
        """Every slot's file removed (a closed manager keeps nothing in the area)."""
        with self._lock:
            for s in self._slots:
                s.view = np.zeros(0, np.uint8)
                s.size = 0
                s.busy = True  # never filled again
                try:
                    os.unlink(s.path)
                except FileNotFoundError:
                    pass


def _lease(view: memoryview) -> ctypes.Array[ctypes.c_uint8]:
    """One use of a slot: an object exporting ``view``'s bytes that every numpy view
    of them refers to (numpy keeps the exporter as their base), so a weak reference
    to it says when the last view is gone. A ctypes array over the mapping's
    address, holding ``view`` (the mapping stays exported while it lives): Python
    3.11 has no ``__buffer__`` for a class of our own."""
    address = np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0
    lease = (ctypes.c_uint8 * len(view)).from_address(address) if len(view) else \
        (ctypes.c_uint8 * 0)()
    lease._mtc_view = view  # type: ignore[attr-defined]
    return lease


class _Mapped:
    def __init__(self, mm: mmap.mmap, size: int) -> None:
        self.mm = mm
        self.size = size
        self.use = 0
        self.busy = False


class SlotMaps:
    """The reading side's mappings of the other side's slots. Thread-safe."""

    def __init__(self, area: Path, *, prefix: str = INPUT_PREFIX) -> None:
        self.area = area
        self._name = re.compile(re.escape(prefix) + _TAG)
        self.boot = uuid.uuid4().hex
        self._maps: dict[str, _Mapped] = {}
        self._stale: set[str] = set()  # forgotten once released (forget_all)
        # Reentrant: a lease may be released by the thread that holds it.
        self._lock = threading.RLock()

    def view(self, name: str, use: int, size: int) -> np.ndarray:
        """A read-only uint8 view of ``size`` bytes of slot ``name``'s use ``use``.
        ProtocolError for a bad name, or a slot whose last use is still held."""
        if not isinstance(name, str) or not self._name.fullmatch(name):
            raise ProtocolError(f"message names a bad slot {name!r}")
        with self._lock:
            m = self._maps.get(name)
            if m is not None and m.busy:
                raise ProtocolError(f"slot {name} was refilled while use {m.use} of it "
                                    "is still held")
            if m is None or m.size < size:
                m = self._map(name, size, m)
            m.use, m.busy = int(use), True
            lease = _lease(memoryview(m.mm)[:size])
            weakref.finalize(lease, self._released, name, m.use)
            out = np.frombuffer(lease, np.uint8)
            out.flags.writeable = False  # the mapping is read-only: ctypes does not know
            return out

    def _map(self, name: str, size: int, old: _Mapped | None) -> _Mapped:
        fd = os.open(self.area / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            have = os.fstat(fd).st_size
            if have < size:
                raise ProtocolError(f"slot {name} has {have} bytes, {size} were named")
            mm = mmap.mmap(fd, have, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        m = _Mapped(mm, have)
        if old is not None:
            m.use = old.use
        self._maps[name] = m
        return m

    def _released(self, name: str, use: int) -> None:
        with self._lock:
            m = self._maps.get(name)
            if m is not None and m.use == use:
                m.busy = False
                if name in self._stale:
                    self._stale.discard(name)
                    del self._maps[name]

    def report(self) -> dict[str, list[Any]]:
        """Each slot's last use and whether it is still held."""
        with self._lock:
            return {n: [m.use, m.busy] for n, m in self._maps.items()}

    def forget_all(self) -> None:
        """Forget every slot (their writer restarted: its new slots have other
        names): those no view holds now, the others once their last view goes (a
        mapping lives on while a view holds it, and no longer)."""
        with self._lock:
            for n, m in list(self._maps.items()):
                if m.busy:
                    self._stale.add(n)
                else:
                    del self._maps[n]

    def drop(self, names: list[str]) -> None:
        """Forget slots (a manager closed); a mapping lives on while a view holds it."""
        with self._lock:
            for n in names:
                self._maps.pop(str(n), None)
