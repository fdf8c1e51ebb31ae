"""A storage backend is a few methods over '/'-separated keys, chosen by URL scheme.

Keys are relative to the URL's prefix. Implementations verify CRC32C end to end
(``put_file`` and ``get_file`` take the expected value) and raise
:class:`BackupUnavailableError` for transient failures (unreachable, 5xx,
throttling) and :class:`CorruptBackupError` when bytes do not match.
"""

from __future__ import annotations

import abc
from pathlib import Path

# Defined with every error (mtc/errors.py), imported from here by the backends.
from mtc.errors import BackupUnavailableError as BackupUnavailableError
from mtc.errors import CorruptBackupError as CorruptBackupError


class Backend(abc.ABC):
    """Where backups live. Thread-safe: several uploads run at once."""

    url: str

    @abc.abstractmethod
    def put_file(self, local: Path, key: str, *, size: int, crc32c: int) -> None:
        """Upload a local file (resumable when large); the store checks the CRC32C."""

    @abc.abstractmethod
    def get_file(self, key: str, local: Path, *, size: int, crc32c: int) -> None:
        """Download to ``local``, verifying size and CRC32C; resumes a partial file."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object (manifests, markers) in one request."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes | None:
        """A small object's bytes, or None if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (recursive), relative to the backend's root."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix``."""

    def can_publish(self) -> bool:
        """Whether :meth:`publish` renames atomically here (HNS bucket, local folder)."""
        return False

    def publish(self, staging: str, final: str) -> bool:
        """Atomically move the folder ``staging`` to ``final`` if the store can
        (an HNS bucket's ``rename_folder``); False means "no atomic rename here"."""
        return False


def open_backend(url: str, *, retry_deadline_s: float | None = None) -> Backend:
    """The backend for a URL: ``file:///path``, ``gs://bucket/prefix``, or any fsspec URL.

    ``retry_deadline_s``: how long one call to a remote store keeps retrying transient
    failures before it raises :class:`BackupUnavailableError` (GCS; default 120 s)."""
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme == "file":
        from mtc.sidecar.backup.local import LocalBackend
        return LocalBackend(url)
    if scheme == "gs":
        from mtc.sidecar.backup.gcs import GcsBackend
        if retry_deadline_s is None:
            return GcsBackend(url)
        if retry_deadline_s <= 0:
            raise ValueError(f"retry deadline must be positive, got {retry_deadline_s}")
        # One request's own timeouts within the deadline too: a request stalled on a
        # cut link otherwise blocks for the 60 s read timeout whatever the deadline.
        return GcsBackend(url, deadline=retry_deadline_s,
                          initial_backoff=min(1.0, retry_deadline_s / 8),
                          max_backoff=min(30.0, retry_deadline_s / 2),
                          timeout=request_timeouts(retry_deadline_s))
    from mtc.sidecar.backup.fsspec_backend import FsspecBackend
    return FsspecBackend(url)


def request_timeouts(retry_deadline_s: float) -> tuple[float, float]:
    """(connect, read) seconds of one request to a remote store retried for
    ``retry_deadline_s``: the defaults (10, 60), shrunk so that a request that
    stalls (a cut link: no reset, no error, just silence) fails, and is retried,
    about within the deadline instead of a minute past it. Never below (1, 5): a
    busy store or machine answering a 16 MiB chunk late is not a stall."""
    return (min(10.0, max(1.0, retry_deadline_s / 4)), min(60.0, max(5.0, retry_deadline_s / 2)))
