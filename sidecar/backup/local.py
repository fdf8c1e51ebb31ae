"""The default backup store: a folder on a local or mounted file system (``file:///path``).

Every file is written under a hidden temporary name and renamed into place, so a key
either holds its whole verified content or does not exist; :meth:`LocalBackend.publish`
renames a whole staging folder in one ``rename(2)``, which a file system does atomically
(refused where anything holds the name: :func:`mtc.sidecar.storage.publish.publish`).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from mtc.errors import MtcError, StepExistsError
from mtc.sidecar.backup.backend import Backend, BackupUnavailableError, CorruptBackupError
from mtc.sidecar.storage.checksum import STREAM_CHUNK, copy_stream
from mtc.sidecar.storage.names import is_tmp, tmp_name
from mtc.sidecar.storage.publish import publish, replace


def _root_of(url: str) -> Path:
    if "://" not in url:
        return Path(url)
    parts = urlsplit(url)
    if parts.scheme != "file":
        raise ValueError(f"not a file:// URL: {url}")
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"file:// URL with a remote host is not supported: {url}")
    return Path(unquote(parts.path))


def check_key(key: str) -> str:
    """Refuse keys that would leave the store's root."""
    if key.startswith("/") or ".." in PurePosixPath(key).parts or "\\" in key:
        raise ValueError(f"invalid backup key {key!r}")
    return key


class LocalBackend(Backend):
    """A folder: ``file:///path`` or a plain path."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.root = _root_of(url).absolute()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put_file(self, local: Path, key: str, *, size: int, crc32c: int) -> None:
        dst = self._path(key)
        with open(local, "rb", buffering=0) as src:  # a missing source is the caller's error
            try:
                dst.parent.mkdir(parents=True, exist_ok=True)
                tmp = tmp_name(dst)
                try:
                    with open(tmp, "wb", buffering=0) as out:
                        n, crc = copy_stream(src, out, 0, STREAM_CHUNK)
                        os.fsync(out.fileno())
                    if (n, crc) != (size, crc32c):
                        raise CorruptBackupError(
                            f"local file has {n} bytes, CRC32C {crc:#010x}; expected {size} "
                            f"bytes, CRC32C {crc32c:#010x}", path=str(local))
                    replace(tmp, dst)
                finally:
                    tmp.unlink(missing_ok=True)
            except OSError as e:
                raise BackupUnavailableError(f"cannot write {dst}: {e}", path=key) from e

    def get_file(self, key: str, local: Path, *, size: int, crc32c: int) -> None:
        src_path = self._path(key)
        tmp = tmp_name(local)
        try:
            with open(src_path, "rb", buffering=0) as src, open(tmp, "wb", buffering=0) as out:
                n, crc = copy_stream(src, out, 0, STREAM_CHUNK)
            if (n, crc) != (size, crc32c):
                raise CorruptBackupError(
                    f"backup object has {n} bytes, CRC32C {crc:#010x}; expected {size} bytes, "
                    f"CRC32C {crc32c:#010x}", path=key)
            replace(tmp, local)
        except FileNotFoundError as e:
            if not src_path.exists():
                raise CorruptBackupError("backup object is missing", path=key) from e
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        dst = self._path(key)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = tmp_name(dst)
            try:
                with open(tmp, "wb", buffering=0) as out:
                    out.write(data)
                    os.fsync(out.fileno())
                replace(tmp, dst)
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as e:
            raise BackupUnavailableError(f"cannot write {dst}: {e}", path=key) from e

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as e:
            raise BackupUnavailableError(f"cannot read {key}: {e}", path=key) from e

    def _walk(self, prefix: str, *, with_tmp: bool) -> list[str]:
        check_key(prefix)
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        keys = []
        for dirpath, _, files in os.walk(base):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if not with_tmp and is_tmp(name):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def list(self, prefix: str) -> list[str]:
        return self._walk(prefix, with_tmp=False)

    def delete_prefix(self, prefix: str) -> None:
        try:
            for key in self._walk(prefix, with_tmp=True):
                (self.root / key).unlink(missing_ok=True)
            # Drop the folders the prefix covers once they are empty.
            base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
            for dirpath, _, _ in sorted(os.walk(base), key=lambda w: -len(w[0])):
                rel = Path(dirpath).relative_to(self.root).as_posix() + "/"
                if rel != "./" and rel.startswith(prefix):
                    try:
                        os.rmdir(dirpath)
                    except OSError:
                        pass  # not empty: something was written there meanwhile
        except OSError as e:
            raise BackupUnavailableError(f"cannot delete {prefix}: {e}", path=prefix) from e

    def can_publish(self) -> bool:
        return True

    def publish(self, staging: str, final: str) -> bool:
        src = self._path(staging.rstrip("/"))
        dst = self._path(final.rstrip("/"))
        if not src.is_dir():
            raise MtcError(f"staging folder {staging} does not exist in {self.url}")
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            publish(src, dst, durable=True)  # atomic; refuses anything there
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise StepExistsError(f"{final} already exists in {self.url}") from e
            raise BackupUnavailableError(f"cannot rename {staging} to {final}: {e}") from e
        return True

