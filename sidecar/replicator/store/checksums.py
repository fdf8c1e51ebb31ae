"""What a replicator remembers of the files it checked: their CRC32C (and SHA-256, once
deduplication asked), keyed by path and valid while the file's inode, size and mtime
are as they were. A steady-state inventory then costs one ``lstat`` per file, and a
step's files written with their checksums (an mtc manifest) are never read again
until one of them changes."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

from mtc.manifest import MANIFEST_NAME
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.storage.checksum import file_crc, file_sha256

CACHE_SWEEP = 50_000  # remembered checksums beyond which files gone are swept out

# (inode, size, mtime_ns): a file rewritten or replaced has another.
Key = tuple[int, int, int]


def _key(st: os.stat_result) -> Key:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class Checksums:
    """Checked files' checksums, safe to use from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # path -> (key, crc32c): files already read and checked; and their SHA-256
        # once one was needed (deduplication asks twice per save: as the sender of a
        # step and as the holder of its twin's identical files).
        self._crcs: dict[str, tuple[Key, int]] = {}
        self._shas: dict[str, tuple[Key, bytes]] = {}
        self._sweep_at = CACHE_SWEEP  # cache size that triggers a sweep for files gone

    def check(self, path: Path | str, meta: FileMeta, *, cached: bool = True) -> str | None:
        """None when ``path`` holds ``meta``'s bytes, else what is wrong."""
        # A string path: inventories check every held file several times a second.
        name = os.fspath(path)
        try:
            st = os.lstat(name)
        except FileNotFoundError:
            return "missing"
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size != meta.size:
            return f"{st.st_size} bytes, expected {meta.size}"
        key = _key(st)
        with self._lock:
            hit = self._crcs.get(name)
        if cached and hit is not None and hit[0] == key:
            value = hit[1]
        else:
            value = file_crc(Path(name))[1]
            with self._lock:
                self._crcs[name] = (key, value)
        if value != meta.crc32c:
            return f"crc32c {value:#010x}, expected {meta.crc32c:#010x}"
        return None

    def sha256(self, path: Path) -> bytes:
        """:func:`file_sha256` of ``path``, remembered while the file is unchanged."""
        name = os.fspath(path)
        key = _key(os.lstat(name))
        with self._lock:
            hit = self._shas.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        digest = file_sha256(Path(name))
        with self._lock:
            self._shas[name] = (key, digest)
        return digest

    def note_verified(self, path: Path, meta: FileMeta) -> None:
        """Remember that ``path`` was just written and checked (no need to read it again)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        with self._lock:
            self._crcs[str(path)] = (_key(st), meta.crc32c)

    def trust_written(self, folder: Path, files: list[FileMeta]) -> None:
        """An mtc step's files were checksummed as they were written (its manifest's
        CRC32Cs): remembered as checked, not read again, as long as each is as it
        was when the manifest (written last) was (not modified after it: by inode,
        size and mtime from here on). A file changed since is read when checked."""
        try:
            written = os.lstat(folder / MANIFEST_NAME).st_mtime_ns
        except OSError:
            return
        fresh = []
        for f in files:
            name = os.fspath(folder / f.path)
            try:
                st = os.lstat(name)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size == f.size and st.st_mtime_ns <= written:
                fresh.append((name, _key(st), f.crc32c))
        with self._lock:
            for name, key, crc in fresh:
                hit = self._crcs.get(name)
                if hit is None or hit[0] != key:  # a result of a read of this file stands
                    self._crcs[name] = (key, crc)

    def drop(self, path: Path) -> None:
        """Forget one file (quarantined: moved away)."""
        with self._lock:
            self._crcs.pop(str(path), None)
            self._shas.pop(str(path), None)

    def forget(self, folder: Path) -> None:
        """Drop what is remembered of the files under ``folder`` (removed): every
        save adds a few hundred paths, and a path that comes back is a new file
        (its key differs), so without this the caches grow with every save.
        Entries of folders removed behind this store's back (the sidecar's
        retention) go once the caches pass a bound."""
        prefix = os.fspath(folder) + os.sep
        with self._lock:
            for cache in (self._crcs, self._shas):
                stale = [k for k in cache if k.startswith(prefix)]
                if len(cache) - len(stale) > self._sweep_at:
                    stale = [k for k in cache if not os.path.lexists(k)]
                    # Many live files: the next sweep waits until the cache doubles
                    # (not one per removal, an lstat of every entry after each save).
                    self._sweep_at = max(CACHE_SWEEP, 2 * (len(cache) - len(stale)))
                for k in stale:
                    del cache[k]

    def __len__(self) -> int:
        with self._lock:
            return len(self._crcs) + len(self._shas)
