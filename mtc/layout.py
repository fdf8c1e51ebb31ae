"""Where steps live on a RAM disk, and what its names mean.

A host root holds committed steps as folders named by the step number. A step
is written into ``<step>.mtc-tmp-<nonce>/`` and becomes visible only through one
atomic rename to ``<step>/``; deletion renames it to ``<step>.mtc-del-<nonce>/``
first, so a crash never leaves a half-deleted folder that looks committed.
Anything that is not a digits-only folder is never read, and mtc's own
leftovers are removed by the host side
(:func:`mtc.sidecar.storage.deleter.clean_uncommitted`). This module names and
reads; every rename, write and removal on a host is
:mod:`mtc.sidecar.storage`'s. A digits-only folder without
mtc's manifest (an Orbax step in the same folder) is foreign: never listed as a
step, read, replaced or deleted (:func:`is_mtc_step`).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from mtc.errors import InvalidStepError
from mtc.manifest import MANIFEST_NAME
from mtc.validate import MAX_STEP

TMP_MARK = ".mtc-tmp-"
DEL_MARK = ".mtc-del-"
# One writer per host root (mtc.root_lock).
LOCK_NAME = ".mtc-writer.lock"
_STEP_DIGITS = len(str(MAX_STEP))
# A host root's identity: a random token the host side writes once at the root; the
# replicator serving that RAM disk reports what it finds at its --local-dir, so a
# manager and a replicator that do not serve the same folder are told apart at
# start without any path crossing between hosts.
ROOT_ID_NAME = ".mtc-root-id"
ROOT_ID_MAX = 64


# Orbax's root metadata (``CheckpointManager(metadata=...)``), as JSON text: kept by
# the first writer that gives it, never replaced (as Orbax's); bounded, being read
# into every open's answer.
ROOT_METADATA_NAME = ".mtc-root-metadata.json"
ROOT_METADATA_MAX = 1 << 20


def root_metadata(root: Path) -> str:
    """The root metadata kept at ``root`` as JSON text ("" when none is kept)."""
    try:
        with open(root / ROOT_METADATA_NAME, "rb") as f:
            data = f.read(ROOT_METADATA_MAX + 1)
    except (FileNotFoundError, NotADirectoryError):
        return ""
    return data.decode("utf-8", "replace") if len(data) <= ROOT_METADATA_MAX else ""


def root_identity(root: Path) -> str:
    """The identity written at ``root`` ("" when none is there, or not one of ours);
    the host side writes one when a manager opens the root
    (:func:`mtc.sidecar.ops.ensure_root_identity`)."""
    path = root / ROOT_ID_NAME
    try:
        with open(path, "rb") as f:
            found = f.read(ROOT_ID_MAX + 1).decode("ascii", "replace").strip()
        if found and len(found) <= ROOT_ID_MAX and found.isalnum():
            return found
    except (FileNotFoundError, NotADirectoryError):
        pass
    return ""


def as_step(step: Any) -> int:
    """``step`` as a Python int: any integer type (int, numpy integer, a 0-d integer
    array such as a flax ``TrainState.step``); anything else is refused."""
    kind = ""
    if isinstance(step, (bool, np.bool_)):
        kind = "b"
    elif isinstance(step, (int, np.integer)):
        kind = "i"
    elif getattr(step, "shape", None) == ():
        try:
            kind = np.dtype(step.dtype).kind
        except TypeError:  # e.g. a typed PRNG key
            kind = ""
    if kind not in ("i", "u"):
        raise InvalidStepError(f"a step must be a non-negative integer (int, numpy integer or "
                               f"0-d integer array), got {type(step).__name__} {step!r}")
    value = int(np.asarray(step)) if not isinstance(step, int) else int(step)
    if value < 0:
        raise InvalidStepError(f"a step must be a non-negative integer, got {value}")
    if value > MAX_STEP:
        raise InvalidStepError(f"a step must be at most {MAX_STEP}, got {value}")
    return value


def host_root(local_dir: str | os.PathLike[str], host: int, subdirs: bool) -> Path:
    """The folder holding ``host``'s steps."""
    return Path(local_dir) / f"host-{host}" if subdirs else Path(local_dir)


def step_dir(root: Path, step: int) -> Path:
    return root / str(step)


def committed_steps(root: Path) -> list[int]:
    """Committed steps under ``root``, oldest first: folders named by a step number
    (a symlink named so is no step: its files are not the host's), in range."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = (step_of_name(n) for n in names)
    return sorted(s for s in steps if s is not None and _is_real_dir(root / str(s)))


def is_mtc_step(root: Path, step: int) -> bool:
    """Whether the committed folder of ``step`` is mtc's: it holds mtc's manifest,
    which mtc writes before the commit's rename. A step folder without one was
    written by another tool (Orbax's steps in the same folder): it is foreign, and
    mtc never offers, reads, replaces or deletes it."""
    return os.path.lexists(step_dir(root, step) / MANIFEST_NAME)


def mtc_steps(root: Path) -> list[int]:
    """Committed steps under ``root`` that are mtc's (:func:`is_mtc_step`), oldest first."""
    return [s for s in committed_steps(root) if is_mtc_step(root, s)]


def foreign_steps(root: Path) -> list[int]:
    """Step folders under ``root`` that are not mtc's (no manifest), oldest first."""
    return [s for s in committed_steps(root) if not is_mtc_step(root, s)]


def step_of_name(name: str) -> int | None:
    """The step a folder name is, written as :func:`step_dir` writes it (ASCII digits,
    no leading zero, in range); None for any other name."""
    if not (name.isascii() and name.isdigit()) or len(name) > _STEP_DIGITS or \
            (name != "0" and name.startswith("0")):
        return None
    value = int(name)
    return value if value <= MAX_STEP else None


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it is gone)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                continue
    return total


@dataclasses.dataclass(frozen=True)
class RootReport:
    """What a host root holds, for ``mtc status --local-dir``."""

    root: Path
    steps: dict[int, int]        # committed step -> bytes
    leftovers: dict[str, int]    # uncommitted or unknown folders -> bytes
    foreign: dict[int, int] = dataclasses.field(default_factory=dict)
    # step folders without mtc's manifest (Orbax's, another tool's) -> bytes


def inspect_root(root: Path) -> RootReport:
    steps: dict[int, int] = {}
    foreign: dict[int, int] = {}
    leftovers: dict[str, int] = {}
    for name in sorted(os.listdir(root)):
        p = root / name
        if not p.is_dir() or p.is_symlink():
            continue
        step = step_of_name(name)
        if step is not None:
            (steps if is_mtc_step(root, step) else foreign)[step] = folder_bytes(p)
        elif name.isdigit():
            leftovers[name] = folder_bytes(p)
        elif TMP_MARK in name or DEL_MARK in name or not (
                name.startswith("host-") or name.startswith(".")):
            # (dot folders are the replicator's own: peer copies, staging)
            leftovers[name] = folder_bytes(p)
    return RootReport(root, dict(sorted(steps.items())), leftovers,
                      dict(sorted(foreign.items())))
