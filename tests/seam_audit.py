"""An audit hook that catches controller code touching a host's RAM disk.

Hosts share nothing: only host-side code (``sidecar/``) may open, list, rename or
delete anything under a RAM disk. Where host-side code runs in the test process
itself (multi-controller and simulated hosts call it in-process), the hook tells
the two apart by the stack: an access under a watched root with a frame of the
controller package (``mtc/``) on the stack and no host-side frame is a leak.
Test code and the standard library (a test corrupting a file on purpose, a
background ``rmtree`` the host side started) are neither and pass.

A host's shared-memory area (``host-<i>/area`` of :mod:`mtc.testing.isolation`,
the part ``/tmp/sidecar`` plays between ``pathways-worker`` and its sidecar) is
where the trainer is meant to hand bytes over; it is not a RAM disk and is exempt.

Where the hosts run their own sidecar processes (:func:`sidecars_only`, the
replicator tests' clusters), host-side code has no business in the test process
either: there any access by ``mtc/`` code is a leak even below a host-side frame
(an in-process ``LocalDispatch``), and so is host-side code that no test frame
called (the writer threads of an in-process agent). The test's own inspection and
damage of the hosts' files (the harness plays the host) has a test frame.

Audit hooks cannot be removed, so one is installed for the session and roots are
watched and unwatched around each test. ``os.stat`` raises no audit event; what
is checked is every open, listing, rename, removal, link and directory change.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_EVENTS = {"open", "os.listdir", "os.scandir", "os.rename", "os.remove", "os.rmdir",
           "os.mkdir", "os.link", "os.symlink", "os.truncate", "os.chmod", "os.utime",
           "shutil.rmtree", "shutil.copyfile", "shutil.move"}
_PKG = Path(__file__).resolve().parents[1]
_CONTROLLER = str(_PKG / "mtc") + os.sep
# Thread runners, like concurrent.futures' (which sits outside mtc/): they run what
# they are handed, and who handed it is not on their thread's stack. A pool's threads
# start in mtc.lifecycle's thread group, which touches no file itself.
_RUNNERS = (str(_PKG / "mtc" / "pool.py"), str(_PKG / "mtc" / "lifecycle.py"))
# A process's own credentials (its certificate, key, CA and token files, wherever its
# configuration names them; tests keep them beside their roots): read by the module
# both the controller and the hosts use, never a host's data.
_CREDENTIALS = str(_PKG / "mtc" / "credentials.py")
# The test harness users get (mtc.testing: the local cluster, its isolated hosts):
# it plays the machine the hosts run on (it makes their folders, writes the cluster's
# state and tokens beside them), as the tests' own harness does; neither controller
# nor host code, so its frames decide nothing (controller code it calls still does).
_HARNESS = str(_PKG / "mtc" / "testing") + os.sep
# Host-side code: sidecar/, imported as mtc.sidecar.
_HOST = (str(_PKG / "sidecar") + os.sep,)

_TESTS = str(_PKG / "tests") + os.sep

_roots: list[str] = []
_strict: list[str] = []  # roots whose hosts run sidecar processes
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
    strict = any(p == r or p.startswith(r + os.sep) for p in paths for r in list(_strict))
    frame = sys._getframe(1)
    controller = host = None
    test = False
    while frame is not None:
        name = frame.f_code.co_filename
        if name == _CREDENTIALS:
            return
        if name in _RUNNERS or name.startswith(_HARNESS):
            pass
        elif name.startswith(_HOST):
            if not strict:
                return  # host-side code: allowed
            host = host or f"{name}:{frame.f_lineno}"
        elif controller is None and name.startswith(_CONTROLLER):
            controller = f"{name}:{frame.f_lineno}"
        elif name.startswith(_TESTS):
            test = True
        frame = frame.f_back
    if controller is None and strict and host is not None and not test:
        controller = f"{host} (host-side code in the test process, its sidecars running)"
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


@contextlib.contextmanager
def watched_root(prefix: str) -> Iterator[Path]:
    """A fresh folder ``/dev/shm/<prefix>-<random>``, watched while the block runs,
    then removed; a leak seen meanwhile fails the test that made it."""
    path = Path("/dev/shm") / f"{prefix}-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    watch(path)
    try:
        yield path
    finally:
        leaks = unwatch(path)
        shutil.rmtree(path, ignore_errors=True)
    assert not leaks, "controller code touched a RAM disk:\n" + "\n".join(leaks[:20])


def sidecars_only(root: Path) -> None:
    """From now on the hosts under ``root`` (a watched root, or a folder in one) are
    reached through their sidecar processes only: host-side code in this process
    no longer excuses an access there, unless a test frame called it."""
    with _lock:
        _strict.append(str(root.resolve()))


def unwatch(root: Path) -> list[str]:
    """Stop watching ``root`` (and what :func:`sidecars_only` marked in it); returns
    the leaks seen (and forgets them)."""
    with _lock:
        r = str(root.resolve())
        if r in _roots:
            _roots.remove(r)
        _strict[:] = [s for s in _strict if not (s == r or s.startswith(r + os.sep))]
        leaks = list(_leaks)
        _leaks.clear()
    return leaks
