"""An audit hook that catches controller code touching a host's RAM disk.

Hosts share nothing: only host-side code (``sidecar/``) may open, list, rename or
delete anything under a RAM disk. Where host-side code runs in the test process
itself (multi-controller and simulated hosts call it in-process), the hook tells
the two apart by the stack: an access under a watched root with a frame of the
controller package (``mtc/``) on the stack and no host-side frame is a leak.
Test code and the standard library (a test corrupting a file on purpose, a
background ``rmtree`` the host side started) are neither and pass.

A host's shared-memory area (``host-<i>/area`` of :mod:`mtc_trainer.isolation`,
the part ``/tmp/sidecar`` plays between ``pathways-worker`` and its sidecar) is
where the trainer is meant to hand bytes over; it is not a RAM disk and is exempt.

Audit hooks cannot be removed, so one is installed for the session and roots are
watched and unwatched around each test. ``os.stat`` raises no audit event; what
is checked is every open, listing, rename, removal, link and directory change.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from pathlib import Path
from typing import Any

_EVENTS = {"open", "os.listdir", "os.scandir", "os.rename", "os.remove", "os.rmdir",
           "os.mkdir", "os.link", "os.symlink", "os.truncate", "os.chmod", "os.utime",
           "shutil.rmtree", "shutil.copyfile", "shutil.move"}
_PKG = Path(__file__).resolve().parents[1]
_CONTROLLER = str(_PKG / "mtc") + os.sep
# Host-side code imports as mtc_sidecar (a symlink to sidecar/): either path.
_HOST = (str(_PKG / "sidecar") + os.sep, str(_PKG / "mtc_sidecar") + os.sep)

_roots: list[str] = []
_leaks: list[str] = []
_lock = threading.Lock()
_installed = False


def _paths(event: str, args: tuple[Any, ...]) -> list[str]:
    if event in ("os.rename", "os.link", "os.symlink", "shutil.copyfile", "shutil.move"):
        cand = args[:2]
    else:
        cand = args[:1]
    out = []
    for a in cand:
        if isinstance(a, (str, bytes, os.PathLike)):
            p = os.fsdecode(a)
            out.append(p if os.path.isabs(p) else os.path.abspath(p))
    return out


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event not in _EVENTS or not _roots:
        return
    try:
        paths = _paths(event, args)
    except Exception:  # noqa: BLE001 - an audit hook must never break the program
        return
    if not any(p == r or p.startswith(r + os.sep) for p in paths for r in list(_roots)):
        return
    if all(_in_area(p) for p in paths):
        return
    frame = sys._getframe(1)
    controller = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_HOST):
            return  # host-side code: allowed
        if controller is None and name.startswith(_CONTROLLER):
            controller = f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    if controller is not None:
        with _lock:
            _leaks.append(f"{event} {paths} from {controller}")


def _in_area(path: str) -> bool:
    parts = path.split(os.sep)
    return any(a == "area" and h.startswith("host-") for h, a in itertools.pairwise(parts))


def watch(root: Path) -> None:
    """Start watching ``root`` (a RAM disk, or the folder of simulated hosts' roots)."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    with _lock:
        _roots.append(str(root.resolve()))


def unwatch(root: Path) -> list[str]:
    """Stop watching ``root``; returns the leaks seen (and forgets them)."""
    with _lock:
        r = str(root.resolve())
        if r in _roots:
            _roots.remove(r)
        leaks = list(_leaks)
        _leaks.clear()
    return leaks
