"""The temporary-name scheme: every name a host's processes write under before a
rename, or hide a folder under before removing it, is made here.

A name holding :data:`~mtc.layout.TMP_MARK` is being written; one holding
:data:`~mtc.layout.DEL_MARK` is being removed. Neither is ever read as a step (not
digits only), listed as a backup object, or served: whoever finds one left by a
crash removes it (:func:`mtc.sidecar.storage.deleter.clean_uncommitted`, the backup
store's listing). The marks are layout's (what a host root's names mean); the
names are built only here.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from mtc.layout import DEL_MARK, TMP_MARK

NONCE_HEX = 12  # random hex digits a name carries: two writers never share one


def _nonce() -> str:
    return uuid.uuid4().hex[:NONCE_HEX]


def tmp_name(path: Path) -> Path:
    """A unique hidden sibling of ``path`` to write a file under before it is
    renamed to ``path`` (:func:`~.publish.replace`, :func:`~.publish.publish`)."""
    return path.with_name(f".{path.name}{TMP_MARK}{_nonce()}")


def tmp_dir(root: Path, step: int) -> Path:
    """A unique folder under ``root`` to write ``step`` into before its commit
    (``<step>.mtc-tmp-<nonce>``: the step it will be stays readable in the name)."""
    return root / f"{step}{TMP_MARK}{_nonce()}"


def deleted_dir(root: Path, name: str) -> Path:
    """A unique name under ``root`` to hide folder ``name`` under before removing it:
    a crash never leaves a half-removed folder under a name that counts."""
    return root / f"{name}{DEL_MARK}{_nonce()}"


def is_tmp(name: str) -> bool:
    """Whether ``name`` is one being written (:func:`tmp_name`, :func:`tmp_dir`)."""
    return TMP_MARK in name


def tmp_step(name: str) -> int | None:
    """The step a :func:`tmp_dir` name is being written for; None for other names."""
    head, mark, _ = name.partition(TMP_MARK)
    return int(head) if mark and head.isascii() and head.isdigit() else None


def partial_name(local: Path) -> Path:
    """Where a download of ``local`` accumulates until it is verified; kept across
    attempts (a download resumes from what it holds), unlike a :func:`tmp_name`."""
    return local.with_name(local.name + ".part")


def aside_name(path: Path, why: str) -> Path:
    """A name beside ``path`` to move an unusable file to, kept for inspection
    (``<name>.<why>-<ns>``)."""
    return path.with_name(f"{path.name}.{why}-{time.time_ns()}")
