"""Google Cloud Storage (``gs://bucket/prefix``), through google-cloud-storage.

- One :class:`google.cloud.storage.Client` serves every thread (its HTTP session is
  shared; each call builds its own ``Blob``), with a connection pool sized for the
  parallel uploads.
- Uploads state the CRC32C the object must have (the manifest's, not one computed from
  the file): GCS refuses a mismatch. Files up to 8 MiB go in one request; larger ones
  are resumable uploads in ``chunk_size`` pieces, a failed chunk re-sent by the client
  library's retry. An object that is not finalized is never visible. The CRC32C GCS
  reports back is checked too, so a store that does not check (an emulator) is caught,
  and the object is deleted again.
- Downloads accumulate in ``<local>.part``; a kept partial file is resumed with a range
  request; the whole file's size and CRC32C are verified before it is renamed to
  ``<local>``.
- Errors: unreachable, 429, 5xx, timeouts, and expired retry deadlines raise
  :class:`BackupUnavailableError`; bytes that do not match raise
  :class:`CorruptBackupError`.
- HNS: on a bucket with hierarchical namespace, :meth:`GcsBackend.publish` renames a
  folder with the Storage Control API's ``RenameFolder`` (atomic, metadata-only, a
  long-running operation it waits for: :mod:`.gcs_folders`). On a flat bucket it
  returns False.

With ``STORAGE_EMULATOR_HOST`` set (tests, fake-gcs-server), the client uses anonymous
credentials and a placeholder project, and the Storage Control API is used only when an
endpoint is given (``control_endpoint`` or ``MTC_STORAGE_CONTROL_ENDPOINT``), over an
insecure channel; emulators have no Storage Control API.
"""

from __future__ import annotations

import base64
import http.client
import logging
import os
import struct
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests
import urllib3
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage import exceptions as storage_exc
from google.cloud.storage.retry import DEFAULT_RETRY

from mtc.errors import MtcError
from mtc.pool import ThreadPool
from mtc.sidecar.backup.backend import Backend, BackupUnavailableError, CorruptBackupError
from mtc.sidecar.backup.gcs_folders import GcsFolders
from mtc.sidecar.backup.local import check_key
from mtc.sidecar.storage.checksum import file_crc
from mtc.sidecar.storage.names import partial_name
from mtc.sidecar.storage.publish import replace

log = logging.getLogger(__name__)

CHUNK_MULTIPLE = 256 << 10  # GCS resumable chunks are multiples of 256 KiB
DEFAULT_CHUNK = 16 << 20
EMULATOR_PROJECT = "mtc-emulator"
CONTROL_ENDPOINT_ENV = "MTC_STORAGE_CONTROL_ENDPOINT"
# The client library sends files up to this size in one multipart request.
SINGLE_REQUEST_MAX: int = getattr(storage.blob, "_MAX_MULTIPART_SIZE", 8 << 20)

# Answers that may succeed later. 401/403 are here too: an operator fixes IAM and the
# next backup interval succeeds; nothing else about the request has to change.
_TRANSIENT: tuple[type[BaseException], ...] = (
    gexc.TooManyRequests, gexc.InternalServerError, gexc.BadGateway,
    gexc.ServiceUnavailable, gexc.GatewayTimeout, gexc.DeadlineExceeded, gexc.RetryError,
    gexc.Unauthorized, gexc.Forbidden, gexc.ResourceExhausted,
    requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.HTTPError, http.client.HTTPException, auth_exc.TransportError,
    ConnectionError, TimeoutError, FutureTimeout,
)


def crc_b64(value: int) -> str:
    """A CRC32C as GCS writes it: base64 of the big-endian 4 bytes."""
    return base64.b64encode(struct.pack(">I", value)).decode()


def parse_gs_url(url: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> ("bucket", "a/b/"); the prefix is empty or ends with '/'."""
    if not url.startswith("gs://"):
        raise ValueError(f"not a gs:// URL: {url}")
    bucket, _, prefix = url[len("gs://"):].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url}")
    prefix = prefix.strip("/")
    return bucket, prefix + "/" if prefix else ""


class GcsBackend(Backend):
    """A bucket and a prefix in Google Cloud Storage (thread-safe)."""

    def __init__(
        self,
        url: str,
        *,
        client: storage.Client | None = None,
        project: str | None = None,
        control_client: Any = None,
        control_endpoint: str | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        deadline: float = 120.0,
        initial_backoff: float = 1.0,
        max_backoff: float = 30.0,
        timeout: float | tuple[float, float] = (10.0, 60.0),
        pool_size: int = 32,
    ) -> None:
        """``deadline``: seconds one call keeps retrying transient failures;
        ``timeout``: per request, (connect, read) seconds."""
        if chunk_size <= 0 or chunk_size % CHUNK_MULTIPLE:
            raise ValueError(f"chunk_size must be a positive multiple of 256 KiB, got {chunk_size}")
        self.url = url
        self.bucket_name, self.root = parse_gs_url(url)
        self.chunk_size = chunk_size
        self.deadline = deadline
        self.timeout = timeout
        self.emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if client is None:
            if self.emulator:
                client = storage.Client(
                    project=project or os.environ.get("GOOGLE_CLOUD_PROJECT", EMULATOR_PROJECT),
                    credentials=AnonymousCredentials())
            else:
                client = storage.Client(project=project)
            _size_pool(client, pool_size)
            _no_metadata_thread(client)
        self.client = client
        self.bucket = client.bucket(self.bucket_name)
        self.retry = (DEFAULT_RETRY.with_delay(initial=initial_backoff, maximum=max_backoff,
                                               multiplier=2.0).with_timeout(deadline))
        self.folders = GcsFolders(
            self, control_client=control_client,
            control_endpoint=control_endpoint or os.environ.get(CONTROL_ENDPOINT_ENV),
            initial_backoff=initial_backoff, max_backoff=max_backoff)

    # -- helpers ---------------------------------------------------------------

    def _name(self, key: str) -> str:
        return self.root + check_key(key)

    def _blob(self, key: str, **kw: Any) -> storage.Blob:
        return self.bucket.blob(self._name(key), **kw)

    @contextmanager
    def errors(self, what: str, key: str) -> Iterator[None]:
        """Translate client-library errors into the backend's two kinds."""
        try:
            yield
        except MtcError:
            raise
        except storage_exc.DataCorruption as e:
            raise CorruptBackupError(f"{what}: checksum mismatch in transit: {e}",
                                     path=key) from e
        except gexc.BadRequest as e:
            if "crc32c" in str(e).lower():  # GCS refused the CRC32C we stated
                raise CorruptBackupError(f"{what}: GCS refused the CRC32C: {e}",
                                         path=key) from e
            raise MtcError(f"{what} of gs://{self.bucket_name}/{self._name(key)}: {e}") from e
        except gexc.NotFound as e:
            if what != "upload":
                raise MtcError(f"{what} of gs://{self.bucket_name}/{self.root}{key}: "
                               f"{e}") from e
            # An upload the store no longer knows: a resumable session expired (GCS,
            # after a link was down long enough), or a last chunk re-sent after its
            # answer timed out although the store had finished the object
            # (fake-gcs-server drops the session then), or no bucket yet. The next
            # try starts a new session: typed, so callers retry instead of giving up.
            raise BackupUnavailableError(
                f"upload of gs://{self.bucket_name}/{self.root}{key}: session or bucket not "
                f"found: {e}", path=key) from e
        except _TRANSIENT as e:
            raise BackupUnavailableError(
                f"{what} of gs://{self.bucket_name}/{self.root}{key}: {type(e).__name__}: {e}",
                path=key) from e
        except gexc.GoogleAPICallError as e:
            raise MtcError(f"{what} of gs://{self.bucket_name}/{self.root}{key}: {e}") from e

    # -- objects ---------------------------------------------------------------

    def put_file(self, local: Path, key: str, *, size: int, crc32c: int) -> None:
        actual = os.stat(local).st_size
        if actual != size:
            raise CorruptBackupError(f"local file has {actual} bytes, expected {size}",
                                     path=str(local))
        blob = self._blob(key, chunk_size=self.chunk_size)
        # Sent with the object's metadata (both upload kinds): GCS refuses other bytes.
        blob.crc32c = crc_b64(crc32c)
        with self.errors("upload", key):
            blob.upload_from_filename(
                str(local),
                content_type="application/octet-stream",
                # One request (<= 8 MiB): the server checks the stated CRC32C. Resumable:
                # the library also sends the CRC32C it computed with the last chunk.
                checksum=None if size <= SINGLE_REQUEST_MAX else "crc32c",
                retry=self.retry, timeout=self.timeout)
            if blob.crc32c != crc_b64(crc32c) or blob.size != size:
                # A store that did not check (an emulator), or a local file that changed:
                # take the object back out rather than leave wrong bytes under the key.
                got = blob.crc32c
                try:
                    blob.delete(if_generation_match=blob.generation, retry=self.retry,
                                timeout=self.timeout)
                except gexc.NotFound:
                    pass
                except gexc.GoogleAPICallError as e:
                    log.warning("could not delete corrupt object %s: %s", blob.name, e)
                raise CorruptBackupError(
                    f"uploaded object has {blob.size} bytes, CRC32C {got}; expected {size} "
                    f"bytes, CRC32C {crc_b64(crc32c)}", path=key)

    def get_file(self, key: str, local: Path, *, size: int, crc32c: int) -> None:
        part = partial_name(local)
        offset = part.stat().st_size if part.exists() else 0
        if offset == size and size and file_crc(part) == (size, crc32c):
            replace(part, local)  # fetched and verified before, not yet renamed
            return
        for attempt in range(2):
            if offset >= size:  # nothing left to fetch, or too long: start over
                offset = 0
            blob = self._blob(key)  # no chunk_size: one streamed request, resumed on error
            in_transit = False
            with self.errors("download", key), open(part, "ab" if offset else "wb") as f:
                try:
                    blob.download_to_file(
                        f, start=offset or None,
                        # A range's bytes cannot be checked against the object's hash;
                        # the whole file is checked below either way.
                        checksum="crc32c" if not offset else None,
                        retry=self.retry, timeout=self.timeout)
                except gexc.NotFound as e:
                    part.unlink(missing_ok=True)
                    raise CorruptBackupError("backup object is missing", path=key) from e
                except (storage_exc.DataCorruption, gexc.RequestRangeNotSatisfiable):
                    # Bytes damaged on the way, or a range past the object's end: the
                    # size and CRC check below fails, and the object is fetched again.
                    f.truncate(0)
                    in_transit = True
            got_size, got_crc = file_crc(part)
            if (got_size, got_crc) == (size, crc32c):
                replace(part, local)
                return
            part.unlink(missing_ok=True)
            if attempt or not (offset or in_transit):
                raise CorruptBackupError(
                    f"backup object has {got_size} bytes, CRC32C {crc_b64(got_crc)}; expected "
                    f"{size} bytes, CRC32C {crc_b64(crc32c)}", path=key)
            log.info("download of %s did not verify (resumed from %d); fetching it again",
                     key, offset)
            offset = 0

    def put_bytes(self, key: str, data: bytes) -> None:
        with self.errors("upload", key):
            self._blob(key).upload_from_string(
                data, content_type="application/octet-stream", checksum="crc32c",
                retry=self.retry, timeout=self.timeout)

    def get_bytes(self, key: str) -> bytes | None:
        with self.errors("download", key):
            try:
                return bytes(self._blob(key).download_as_bytes(
                    checksum="crc32c", retry=self.retry, timeout=self.timeout))
            except gexc.NotFound:
                return None

    def list(self, prefix: str) -> list[str]:
        check_key(prefix)
        with self.errors("list", prefix):
            blobs = self.client.list_blobs(self.bucket, prefix=self.root + prefix,
                                           retry=self.retry, timeout=self.timeout)
            return sorted(b.name[len(self.root):] for b in blobs)

    def delete_prefix(self, prefix: str) -> None:
        keys = self.list(prefix)

        def one(key: str) -> None:
            with self.errors("delete", key):
                try:
                    self._blob(key).delete(retry=self.retry, timeout=self.timeout)
                except gexc.NotFound:
                    pass

        if keys:
            with ThreadPool(min(16, len(keys)), "mtc-gcs-rm", lazy=True) as pool:
                list(pool.map(one, keys))
        if (not prefix or prefix.endswith("/")) and self.can_publish():
            # HNS keeps folders after their objects go; a leftover empty folder would
            # make a later rename onto the same name fail.
            self.folders.delete_folders(self.root + prefix)

    # -- HNS -------------------------------------------------------------------

    def can_publish(self) -> bool:
        """Whether the bucket has hierarchical namespace (:mod:`.gcs_folders`)."""
        return self.folders.can_publish()

    def publish(self, staging: str, final: str) -> bool:
        """Rename the folder ``staging`` to ``final`` in one atomic, metadata-only
        operation (HNS); False on a flat bucket."""
        return self.folders.publish(staging, final)

def _no_metadata_thread(client: storage.Client) -> None:
    """Keep the client from fetching bucket metadata behind our back.

    google-cloud-storage 3.17 starts, at a bucket's first request, a daemon
    thread that nobody joins to GET the bucket (for OpenTelemetry span
    attributes, tracing on or off): a request mtc never asked for, needing
    ``storage.buckets.get``, retried on its own schedule after a backup call has
    failed and returned. The library's own switch is process-wide (the
    environment variable DISABLE_GCS_PYTHON_CLIENT_OTEL_BUCKET_METADATA);
    dropping the client's cache turns it off for the clients mtc makes alone.
    Older releases have no such cache: nothing to do."""
    if getattr(client, "_bucket_metadata_cache", None) is not None:
        client._bucket_metadata_cache = None


def _size_pool(client: storage.Client, size: int) -> None:
    """Let ``size`` threads keep connections open (requests' default pool holds 10)."""
    session = getattr(client, "_http", None)
    if isinstance(session, requests.Session):
        adapter = requests.adapters.HTTPAdapter(pool_connections=size, pool_maxsize=size)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
