"""A backup store that stops answering mid-request (a link cut), or answers an
upload with 404 (it forgot the upload session): the GCS backend's calls fail
typed and retryable, within the retry deadline. No cluster: a socket that never
answers and an HTTP server that says 404, on loopback. The same faults on real
isolated hosts: ``tests/test_network_faults.py``."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mtc.sidecar.backup.backend import BackupUnavailableError, open_backend


def test_a_stalled_request_fails_within_the_backup_retry_deadline(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """A store that accepts the connection and then says nothing (a link cut
    mid-request): one request's timeouts fit inside the retry deadline, so the
    call fails, typed, soon after it; not after the default 60 s read timeout."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])  # and never answer
            except TimeoutError:
                continue

    t = threading.Thread(target=accept)
    t.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.getsockname()[1]}")
    before = set(threading.enumerate())
    try:
        backend = open_backend("gs://stalled/b", retry_deadline_s=2.0)
        t0 = time.monotonic()
        with pytest.raises(BackupUnavailableError):
            backend.put_bytes("steps/1/MANIFEST.json", b"{}")
        took = time.monotonic() - t0
        # Nothing the backend started goes on asking the store after the call failed
        # (the storage client's own bucket-metadata thread, for one).
        left = [th.name for th in set(threading.enumerate()) - before if th.is_alive()]
        assert left == [], left
    finally:
        stop.set()
        t.join()
        for s in accepted:
            s.close()
        server.close()
    assert took < 30.0, took  # one request alone used to wait 60 s, then retried


def test_an_upload_the_store_does_not_know_is_retryable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 404 answering an upload (fake-gcs-server's answer to a last chunk re-sent
    after its answer timed out, seen in test_network_faults.py's cut-link test; real GCS's for
    an expired session) is a retryable BackupUnavailableError, not an untyped
    error that ends the backup pass with a traceback."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def answer(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(n)
            body = b'{"error": {"code": 404, "message": "Not Found"}}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = do_POST = answer

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    t = threading.Thread(target=server.serve_forever)
    t.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        backend = open_backend("gs://gone/b", retry_deadline_s=2.0)
        with pytest.raises(BackupUnavailableError, match="not found"):
            backend.put_bytes("steps/1/MANIFEST.json", b"{}")
    finally:
        server.shutdown()
        t.join()
        server.server_close()
