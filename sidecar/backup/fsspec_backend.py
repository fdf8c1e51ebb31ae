"""Any other fsspec URL (``memory://``, ``s3://``, ``abfs://``, ...), through its file system.

Objects are streamed with a running CRC32C: an upload whose source does not match the
expected CRC32C is deleted again, and a download is verified before it is renamed into
place. fsspec file systems have no atomic folder rename, so :meth:`publish` says False
and the caller's commit marker, written last, is the commit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import fsspec

from mtc.sidecar.backup.backend import Backend, BackupUnavailableError, CorruptBackupError
from mtc.sidecar.backup.local import check_key
from mtc.sidecar.storage.checksum import STREAM_CHUNK, copy_stream, file_crc
from mtc.sidecar.storage.names import partial_name
from mtc.sidecar.storage.publish import replace


@contextmanager
def _unavailable(what: str, key: str) -> Iterator[None]:
    try:
        yield
    except (FileNotFoundError, CorruptBackupError, BackupUnavailableError):
        raise
    except (OSError, ConnectionError, TimeoutError) as e:
        raise BackupUnavailableError(f"{what} failed: {e}", path=key) from e


class FsspecBackend(Backend):
    """A backend over ``fsspec.core.url_to_fs(url)``."""

    def __init__(self, url: str, **storage_options: object) -> None:
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}" if key else self.root

    def put_file(self, local: Path, key: str, *, size: int, crc32c: int) -> None:
        path = self._path(key)
        with open(local, "rb", buffering=0) as src, _unavailable("upload", key):
            self.fs.makedirs(self.fs._parent(path), exist_ok=True)
            with self.fs.open(path, "wb") as out:
                n, crc = copy_stream(src, out, 0, STREAM_CHUNK)
            if (n, crc) != (size, crc32c):
                self.fs.rm_file(path)
                raise CorruptBackupError(
                    f"local file has {n} bytes, CRC32C {crc:#010x}; expected {size} bytes, "
                    f"CRC32C {crc32c:#010x}", path=str(local))

    def get_file(self, key: str, local: Path, *, size: int, crc32c: int) -> None:
        path = self._path(key)
        part = partial_name(local)
        offset = part.stat().st_size if part.exists() else 0
        for attempt in range(2):
            if offset > size:
                offset = 0
            crc = file_crc(part)[1] if offset else 0
            with _unavailable("download", key):
                try:
                    mode = "ab" if offset else "wb"
                    with self.fs.open(path, "rb") as src, open(part, mode) as out:
                        if offset:
                            src.seek(offset)
                        n, crc = copy_stream(src, out, crc, STREAM_CHUNK)
                except FileNotFoundError as e:
                    raise CorruptBackupError("backup object is missing", path=key) from e
            if (offset + n, crc) == (size, crc32c):
                replace(part, local)
                return
            part.unlink(missing_ok=True)
            if offset == 0 or attempt:
                raise CorruptBackupError(
                    f"backup object has {offset + n} bytes, CRC32C {crc:#010x}; expected "
                    f"{size} bytes, CRC32C {crc32c:#010x}", path=key)
            offset = 0  # the kept partial file did not belong to this object: start over

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with _unavailable("write", key):
            self.fs.makedirs(self.fs._parent(path), exist_ok=True)
            self.fs.pipe_file(path, data)

    def get_bytes(self, key: str) -> bytes | None:
        with _unavailable("read", key):
            try:
                return bytes(self.fs.cat_file(self._path(key)))
            except FileNotFoundError:
                return None

    def list(self, prefix: str) -> list[str]:
        check_key(prefix)
        base = self._path(prefix.rsplit("/", 1)[0]) if "/" in prefix else self.root
        with _unavailable("list", prefix):
            try:
                found = self.fs.find(base)
            except FileNotFoundError:
                return []
        start = len(self.root) + 1
        keys = (p[start:] for p in found if p.startswith(self.root + "/"))
        return sorted(k for k in keys if k.startswith(prefix))

    def delete_prefix(self, prefix: str) -> None:
        keys = self.list(prefix)
        with _unavailable("delete", prefix):
            if keys:
                self.fs.rm([self._path(k) for k in keys])
            if prefix.endswith("/") and self.fs.isdir(self._path(prefix.rstrip("/"))):
                try:  # the folder itself, on file systems that keep folders
                    self.fs.rm(self._path(prefix.rstrip("/")), recursive=True)
                except FileNotFoundError:
                    pass
