"""A GCS bucket's folders under hierarchical namespace (HNS), through the Storage
Control API (gRPC): whether the bucket has them (asked once), a staged folder
renamed to its final name in one atomic, metadata-only operation (a long-running
operation waited for), and empty folders deleted after their objects (a leftover
would make a later rename onto its name fail). Objects themselves are
:mod:`.gcs`'s; so are the errors' translation and the retries' deadline."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import TYPE_CHECKING, Any

from google.api_core import exceptions as gexc
from google.api_core import retry as gretry

from mtc.errors import StepExistsError
from mtc.sidecar.backup.local import check_key

if TYPE_CHECKING:
    from mtc.sidecar.backup.gcs import GcsBackend

log = logging.getLogger(__name__)

# Storage Control (gRPC) errors worth another try.
_CONTROL_RETRY_TYPES = (gexc.ServiceUnavailable, gexc.DeadlineExceeded,
                        gexc.InternalServerError, gexc.TooManyRequests)


class GcsFolders:
    """The folders of ``gcs``'s bucket. ``control_client``: a Storage Control
    client (default: made at first use, at ``control_endpoint`` when given; none
    against an emulator without one: a flat bucket)."""

    def __init__(self, gcs: GcsBackend, *, control_client: Any, control_endpoint: str | None,
                 initial_backoff: float, max_backoff: float) -> None:
        self._gcs = gcs
        self._retry = gretry.Retry(
            predicate=gretry.if_exception_type(*_CONTROL_RETRY_TYPES), initial=initial_backoff,
            maximum=max_backoff, multiplier=2.0, timeout=gcs.deadline)
        self._control = control_client
        self._control_endpoint = control_endpoint
        self._control_lock = threading.Lock()
        self._hns: bool | None = None

    def _control_client(self) -> Any:
        with self._control_lock:
            if self._control is None:
                from google.cloud import storage_control_v2

                client_class = storage_control_v2.StorageControlClient
                if self._control_endpoint and self._gcs.emulator:
                    import grpc

                    # A local test server: plain gRPC, no credentials.
                    transport = client_class.get_transport_class("grpc")(
                        channel=grpc.insecure_channel(self._control_endpoint))
                    self._control = client_class(transport=transport)
                elif self._control_endpoint:
                    self._control = client_class(
                        client_options={"api_endpoint": self._control_endpoint})
                elif self._gcs.emulator:
                    return None  # emulators have no Storage Control API: a flat bucket
                else:
                    self._control = client_class()
            return self._control

    def _bucket_path(self) -> str:
        return f"projects/_/buckets/{self._gcs.bucket_name}"

    def _folder_path(self, folder_id: str) -> str:
        return f"{self._bucket_path()}/folders/{folder_id}"

    def can_publish(self) -> bool:
        """Whether the bucket has hierarchical namespace (asked once, then cached)."""
        if self._hns is not None:
            return self._hns
        control = self._control_client()
        if control is None:
            self._hns = False
            return False
        with self._gcs.errors("storage layout", ""):
            try:
                layout = control.get_storage_layout(
                    name=f"{self._bucket_path()}/storageLayout", retry=self._retry,
                    timeout=self._rpc_timeout())
                self._hns = bool(layout.hierarchical_namespace.enabled)
            except (gexc.PermissionDenied, gexc.NotFound, gexc.MethodNotImplemented,
                    gexc.InvalidArgument) as e:
                log.warning("cannot read the storage layout of %s (%s): treating it as a "
                            "flat bucket", self._gcs.bucket_name, e)
                self._hns = False
        return self._hns

    def _rpc_timeout(self) -> float:
        t = self._gcs.timeout
        return t[1] if isinstance(t, tuple) else t

    def _objects_under(self, name_prefix: str) -> bool:
        it = self._gcs.client.list_blobs(self._gcs.bucket, prefix=name_prefix, max_results=1,
                                         retry=self._gcs.retry, timeout=self._gcs.timeout)
        return any(True for _ in it)

    def delete_folders(self, folder_prefix: str) -> None:
        control = self._control_client()
        with self._gcs.errors("delete folders", folder_prefix[len(self._gcs.root):]):
            from google.cloud import storage_control_v2

            listing = control.list_folders(
                request=storage_control_v2.ListFoldersRequest(
                    parent=self._bucket_path(), prefix=folder_prefix),
                retry=self._retry, timeout=self._rpc_timeout())
            folders = {f.name.split("/folders/", 1)[1] for f in listing
                       if "/folders/" in f.name}
            if folder_prefix:
                folders.add(folder_prefix)
            folders.discard(self._gcs.root)
            for folder_id in sorted(folders, key=lambda f: (-f.count("/"), f)):
                try:
                    control.delete_folder(name=self._folder_path(folder_id),
                                          retry=self._retry,
                                          timeout=self._rpc_timeout())
                except (gexc.NotFound, gexc.FailedPrecondition):
                    pass  # gone already, or written to meanwhile: leave it

    def publish(self, staging: str, final: str) -> bool:
        """Rename the folder ``staging`` to ``final`` in one atomic, metadata-only
        operation (HNS); False on a flat bucket."""
        if not self.can_publish():
            return False
        control = self._control_client()
        src = self._gcs.root + check_key(staging.strip("/")) + "/"
        dst = self._gcs.root + check_key(final.strip("/")) + "/"
        from google.cloud import storage_control_v2

        with self._gcs.errors("publish", final):
            # Objects create their folders; the destination's parent may not exist yet.
            parent = dst[: dst.rstrip("/").rfind("/") + 1]
            src_parent = src[: src.rstrip("/").rfind("/") + 1]
            if parent and parent != self._gcs.root and parent != src_parent:
                try:
                    control.create_folder(
                        request=storage_control_v2.CreateFolderRequest(
                            parent=self._bucket_path(), folder_id=parent, recursive=True),
                        retry=self._retry, timeout=self._rpc_timeout())
                except gexc.AlreadyExists:
                    pass
            try:
                control.get_folder(name=self._folder_path(dst), retry=self._retry,
                                   timeout=self._rpc_timeout())
                exists = True
            except gexc.NotFound:
                exists = False
            if exists:
                if self._objects_under(dst):
                    raise StepExistsError(f"{final} already exists in {self._gcs.url}")
                self.delete_folders(dst)  # an empty leftover folder: replace it
            try:
                # request_id makes the client's retries of this call idempotent.
                operation = control.rename_folder(
                    request=storage_control_v2.RenameFolderRequest(
                        name=self._folder_path(src), destination_folder_id=dst,
                        request_id=str(uuid.uuid4())),
                    retry=self._retry, timeout=self._rpc_timeout())
                operation.result(timeout=self._gcs.deadline)
            except gexc.AlreadyExists as e:  # someone published the same step meanwhile
                raise StepExistsError(f"{final} already exists in {self._gcs.url}") from e
        log.info("published %s as %s in gs://%s", src, dst, self._gcs.bucket_name)
        return True
