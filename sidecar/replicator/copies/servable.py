"""What a holder may serve of a fetch: one rule for both fetch paths, the data
channel's (:mod:`mtc.sidecar.replicator.wire.data_service`) and gRPC's Data service
(:mod:`mtc.sidecar.replicator.wire.grpc_data`), decided from the request's origin
rank, step and paths before any file is opened.

Of rank ``origin``'s step ``step`` a holder serves:

- a copy it holds complete (its own step, or a peer's copy), every path one of the
  copy's described files; each file is then checked as it is sent;
- else its own step while it restores it from the backup, every path one it has
  read and verified already (another restoring host asks it rather than the backup);
- else nothing: its own step it does not restore the asker reads from the backup
  itself (:class:`~mtc.errors.ConfigError`, FAILED_PRECONDITION: the asker's
  ``HolderIdle``), and anything else is not here (:class:`~mtc.errors.StepNotFoundError`).

A request is refused whole when one of its paths may not be served: never after
part of it was sent.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mtc.errors import ConfigError, CorruptShardError, StepNotFoundError
from mtc.integrity import crc32c
from mtc.sidecar.confine import open_beneath
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.storage.checksum import CHUNK

if TYPE_CHECKING:
    from mtc.sidecar.replicator.store.store import LocalStore

HELD = "held"      # a copy held here: each file checked against its description as sent
STAGED = "staged"  # a restore's files, verified as they were read from the backup


@dataclasses.dataclass(frozen=True)
class Serving:
    """Where a fetch's files come from (:data:`HELD` or :data:`STAGED`) and, of a
    held copy, each path's description, in the request's order."""

    source: str
    files: tuple[FileMeta, ...] = ()


def servable(origin: int, step: int, paths: Sequence[str], *, rank: int,
             held: Sequence[FileMeta] | None, staged: Collection[str] | None) -> Serving:
    """The rule, pure. ``rank``: the holder's; ``held``: the described files of its
    complete copy of (``origin``, ``step``), None when it holds none; ``staged``: the
    paths of ``step`` its restore in progress has verified, None when it restores
    none of it."""
    if held is not None:
        described = {f.path: f for f in held}
        for p in paths:
            if p not in described:
                raise FileNotFoundError(f"{p} is not part of rank {origin} step {step}")
        return Serving(HELD, tuple(described[p] for p in paths))
    if origin != rank:
        raise StepNotFoundError("no complete copy here", step=step, host=origin)
    if staged is None:
        raise ConfigError(f"rank {origin} is not restoring step {step}")
    for p in paths:
        if p not in staged:
            raise StepNotFoundError("not read from the backup yet", step=step, host=origin,
                                    path=p)
    return Serving(STAGED)


def serving(store: LocalStore, staged: Callable[[int], tuple[Path, set[str]] | None],
            rank: int, origin: int, step: int, paths: Sequence[str]) -> tuple[Serving, Path]:
    """The rule on what this host holds now, and the folder its files are read from.
    ``staged``: a step's restore in progress here (its folder, the paths verified),
    asked only of this host's own step that it holds no copy of."""
    if (origin, step) in store.copies():
        held = store.describe(origin, step)
        return servable(origin, step, paths, rank=rank, held=held, staged=None), \
            store.copy_dir(origin, step)
    restoring = staged(step) if origin == rank else None
    plan = servable(origin, step, paths, rank=rank, held=None,
                    staged=None if restoring is None else restoring[1])
    assert restoring is not None  # servable refuses a step neither held nor staged
    return plan, restoring[0]


def stream_verified(store: LocalStore, origin: int, step: int, meta: FileMeta,
                    offset: int = 0) -> Iterator[bytes]:
    """A file of a copy held in ``store`` (``meta``: as the copy describes it): its
    bytes from ``offset``, CRC32C checked as they are read; the last chunk is held
    back until the check passes, so a reader never gets a whole file that fails (the
    file is quarantined and CorruptShardError raised)."""
    rel = meta.path
    if not 0 <= offset <= meta.size:
        raise ValueError(f"offset {offset} outside {rel} ({meta.size} bytes)")
    folder = store.copy_dir(origin, step)
    path = folder / rel
    value = 0
    # Opened part by part without following a symlink: nothing outside the copy
    # is ever sent, whatever was planted in it.
    under = folder.relative_to(store.root).as_posix()
    with os.fdopen(open_beneath(store.root, f"{under}/{rel}"), "rb", buffering=0) as f:
        done = 0
        while done < offset:  # the part before the offset, checked in chunks too
            part = f.read(min(CHUNK, offset - done))
            if not part:
                break
            value = crc32c(part, value)
            done += len(part)
        held = f.read(CHUNK)
        while held:
            value = crc32c(held, value)
            nxt = f.read(CHUNK)
            if not nxt:
                break
            yield held
            held = nxt
        size = f.tell()
    if size != meta.size or value != meta.crc32c:
        store.quarantine_file(path, f"{size} bytes crc32c {value:#010x} when sent, "
                                   f"expected {meta.size} bytes {meta.crc32c:#010x}",
                             origin=origin, step=step)
        raise CorruptShardError("held copy failed its checksum; quarantined", step=step,
                                host=origin, path=rel)
    if held:
        yield held
