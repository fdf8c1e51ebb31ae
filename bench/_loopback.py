"""The references ``bench/replicator.py`` measures the replicator against, over
loopback: raw TCP (a buffer sent and received), a plain file copy between RAM
disks (one connection each), and the floor of a fetch into an emptied RAM disk
(a few connections at once)."""

from __future__ import annotations

import os
import queue
import shutil
import socket
import threading
import time
from pathlib import Path

from mtc.integrity import crc32c
from mtc.sidecar.replicator.wire.socket_files import RECV_CHUNK, recv_into_fd

TCP_CHUNK = 4 << 20


class _Loopback:
    """One loopback connection from the caller to a receiver thread (``_receive``),
    which acknowledges each transfer with one byte."""

    def __init__(self) -> None:
        self.errors: list[OSError] = []
        self._srv = socket.socket()
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(1)
        self._thread = threading.Thread(target=self._receive, name=type(self).__name__,
                                        daemon=True)
        self._thread.start()
        self._sock = socket.create_connection(self._srv.getsockname())
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _receive(self) -> None:
        raise NotImplementedError

    def _acknowledged(self, what: str) -> None:
        if self._sock.recv(1) != b"k":
            raise OSError(f"{what} receiver failed: {self.errors}")

    def close(self) -> None:
        self._sock.close()
        self._thread.join(10)
        self._srv.close()


class RawTcp(_Loopback):
    """Raw loopback TCP; :meth:`sample` times one transfer of the payload."""

    def __init__(self, payload: memoryview) -> None:
        self.payload = payload
        super().__init__()

    def _receive(self) -> None:
        try:
            conn, _ = self._srv.accept()
            buf = bytearray(TCP_CHUNK)  # preallocated, reused
            view = memoryview(buf)
            with conn:
                while True:
                    left = len(self.payload)
                    while left:
                        n = conn.recv_into(view, min(left, TCP_CHUNK))
                        if not n:
                            return  # the sender closed
                        left -= n
                    conn.sendall(b"k")
        except OSError as e:  # reported by the sender
            self.errors.append(e)

    def sample(self) -> float:
        """Seconds to send the payload in 4 MiB ``sendall`` calls, until acknowledged."""
        t0 = time.perf_counter()
        for off in range(0, len(self.payload), TCP_CHUNK):
            self._sock.sendall(self.payload[off:off + TCP_CHUNK])
        self._acknowledged("raw TCP")
        return time.perf_counter() - t0


class RawFileCopy(_Loopback):
    """A plain copy between RAM disks, without gRPC or Python per-chunk objects: each
    file ``sendfile``d over one loopback connection; the receiver thread
    ``recv_into``s a preallocated 4 MiB buffer, CRC32Cs it and writes it to a new file."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self._todo: queue.Queue[list[tuple[str, int]] | None] = queue.Queue()
        super().__init__()

    def _receive(self) -> None:
        try:
            conn, _ = self._srv.accept()
            buf = bytearray(TCP_CHUNK)
            view = memoryview(buf)
            with conn:
                while (files := self._todo.get()) is not None:
                    for name, size in files:
                        fd = os.open(self.dest / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                     0o644)
                        try:
                            left, value = size, 0
                            while left:
                                n = conn.recv_into(view, min(left, TCP_CHUNK))
                                if not n:
                                    raise OSError("sender closed early")
                                value = crc32c(view[:n], value)
                                done = 0
                                while done < n:
                                    done += os.write(fd, view[done:n])
                                left -= n
                        finally:
                            os.close(fd)
                    conn.sendall(b"k")
        except OSError as e:  # reported by the sender
            self.errors.append(e)

    def sample(self, paths: list[Path]) -> float:
        """Seconds to copy ``paths`` into ``dest``, until the receiver acknowledges."""
        shutil.rmtree(self.dest, ignore_errors=True)
        self.dest.mkdir(parents=True)
        sizes = [p.stat().st_size for p in paths]
        self._todo.put([(p.name, n) for p, n in zip(paths, sizes, strict=True)])
        out = self._sock.fileno()
        t0 = time.perf_counter()
        for p, size in zip(paths, sizes, strict=True):
            fd = os.open(p, os.O_RDONLY)
            try:
                offset = 0
                while offset < size:
                    offset += os.sendfile(out, fd, offset, size - offset)
            finally:
                os.close(fd)
        self._acknowledged("raw copy")
        dt = time.perf_counter() - t0
        shutil.rmtree(self.dest, ignore_errors=True)
        return dt

    def close(self) -> None:
        self._todo.put(None)
        super().close()


class RawFetch:
    """The floor of a replaced host's fetch: ``streams`` loopback connections at once,
    each carrying a consecutive share of the files, ``sendfile``d by one thread and
    received by another into new files of an emptied RAM-disk folder with the
    replicator's own byte mover (``socket_files.recv_into_fd``: ``splice``, then
    a CRC32C over the written pages). The replicator's fetch adds its agreement,
    protocol, checks and commit. New tmpfs pages are allocated and
    cleared as they are first written, which bounds both here; ``held``: the files
    are allocated (``posix_fallocate``) before the clock starts, as a replaced
    host's replicator sets its restore's files aside before the restore comes."""

    def __init__(self, dest: Path, streams: int, *, held: bool = False) -> None:
        self.dest = dest
        self.streams = streams
        self.held = held

    def sample(self, paths: list[Path]) -> float:
        """Seconds to fetch ``paths`` into the emptied ``dest``, every stream done."""
        shutil.rmtree(self.dest, ignore_errors=True)
        self.dest.mkdir(parents=True)
        sizes = [p.stat().st_size for p in paths]
        if self.held:
            for path, size in zip(paths, sizes, strict=True):
                fd = os.open(self.dest / path.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.posix_fallocate(fd, 0, size)
                finally:
                    os.close(fd)
        share = -(-len(paths) // self.streams)
        parts = [list(range(i, min(i + share, len(paths))))
                 for i in range(0, len(paths), share)]
        errors: list[BaseException] = []
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(len(parts))

            def send(ks: list[int]) -> None:
                try:
                    with socket.create_connection(srv.getsockname()) as s:
                        for k in ks:
                            with open(paths[k], "rb") as f:
                                s.sendfile(f, 0, sizes[k])
                        s.recv(1)
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            def receive(conn: socket.socket, ks: list[int]) -> None:
                try:
                    buf = memoryview(bytearray(RECV_CHUNK))  # used only where splice is not
                    with conn:
                        for k in ks:
                            fd = os.open(self.dest / paths[k].name, os.O_RDWR if self.held
                                         else os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                            try:
                                got, _ = recv_into_fd(conn, fd, sizes[k], buf)
                            finally:
                                os.close(fd)
                            if got != sizes[k]:
                                raise OSError(f"{got} of {sizes[k]} bytes arrived")
                        conn.sendall(b"k")
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=send, args=(ks,)) for ks in parts]
            for t in threads:
                t.start()
            for ks in parts:
                conn, _ = srv.accept()
                threads.append(threading.Thread(target=receive, args=(conn, ks)))
                threads[-1].start()
            for t in threads:
                t.join()
            dt = time.perf_counter() - t0
        shutil.rmtree(self.dest, ignore_errors=True)
        if errors:
            raise OSError(f"raw fetch failed: {errors}")
        return dt
