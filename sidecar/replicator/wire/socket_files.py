"""A file's bytes between a socket and a file, for the data channel (``datachannel.py``).

The sender hands the kernel whole files (``os.sendfile``: no byte passes through
Python; over TLS, where the kernel cannot, plain reads). On a plain socket the
receiver has the kernel move the bytes into the file (``splice`` through a pipe)
and takes their CRC32C over the file's pages once written; over TLS it makes one
pass over each byte: ``recv_into`` a reused buffer, CRC32C, write.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import socket
import ssl
from collections.abc import Callable
from typing import BinaryIO

from mtc.integrity import crc32c

# Bytes per receive: small enough that the CRC32C and the write read them from the
# cache the receive just filled (a whole CHUNK would go out to memory and back).
RECV_CHUNK = 256 << 10


def recv_into_fd(sock: socket.socket, fd: int, size: int, buf: memoryview,
                 progress: Callable[[int], None] | None = None) -> tuple[int, int]:
    """``size`` bytes of the stream (fewer when it ends early) into ``fd`` (opened for
    reading and writing, at its start); (bytes got, their CRC32C). ``progress``: told
    each part's length (the stream watchdog's rate).

    On a plain socket the kernel moves the bytes into the file (``splice`` through a
    pipe: no copy through Python), and the CRC32C is taken over the file's pages
    once written; over TLS, one pass: ``recv_into`` ``buf``, CRC32C, write."""
    if _SPLICE and not isinstance(sock, ssl.SSLSocket):
        got = _splice_into_fd(sock, fd, size, progress)
        return got, _crc_of_fd(fd, got, buf)
    got = value = 0
    while got < size:
        n = sock.recv_into(buf, min(len(buf), size - got))
        if not n:
            break
        part = buf[:n]
        value = crc32c(part, value)
        done = 0
        while done < n:
            done += os.write(fd, part[done:])
        got += n
        if progress is not None:
            progress(n)
    return got, value


_SPLICE = hasattr(os, "splice")
SPLICE_PIPE = 1 << 20  # the pipe's capacity asked for (the kernel's default is 64 KiB)
_F_SETPIPE_SZ = 1031


def _splice_into_fd(sock: socket.socket, fd: int, size: int,
                    progress: Callable[[int], None] | None) -> int:
    """Move up to ``size`` bytes from ``sock`` into ``fd`` through a pipe of its own;
    the bytes moved. Waits for the socket at most its timeout each time."""
    r, w = os.pipe()
    try:
        try:
            cap = fcntl.fcntl(w, _F_SETPIPE_SZ, SPLICE_PIPE)
        except OSError:
            cap = 64 << 10
        got = 0
        while got < size:
            try:
                n = os.splice(sock.fileno(), w, min(cap, size - got))
            except BlockingIOError:  # a socket with a timeout is non-blocking underneath
                if not select.select([sock], [], [], sock.gettimeout())[0]:
                    raise TimeoutError(f"no bytes for {sock.gettimeout()}s") from None
                continue
            except (ConnectionError, TimeoutError):
                raise
            except OSError as e:
                # The socket's side failed (a link cut mid-stream, the stream
                # watchdog's shutdown): the connection ended, nothing is answered.
                # Seen as EINVAL from the kernel during a cut; never an internal error.
                raise ConnectionError(e.errno, f"receiving failed: {e.strerror}") from e
            if not n:
                break
            moved = 0
            while moved < n:
                moved += os.splice(r, fd, n - moved)
            got += n
            if progress is not None:
                progress(n)
        return got
    finally:
        os.close(r)
        os.close(w)


def _crc_of_fd(fd: int, size: int, buf: memoryview) -> int:
    """CRC32C of the first ``size`` bytes of ``fd``: over its pages in place, or read
    through ``buf`` where they cannot be mapped."""
    if not size:
        return 0
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            view = memoryview(m)
            try:
                return crc32c(view)
            finally:
                view.release()
    except (OSError, ValueError):
        value = done = 0
        while done < size:
            n = os.preadv(fd, [buf[:min(len(buf), size - done)]], done)
            if not n:
                break
            value = crc32c(buf[:n], value)
            done += n
        return value


# Bytes per send: the stream watchdog sees a file's progress part by part (a whole
# 128 MiB file counted only once sent cut a reader off at 16 times the minimum rate).
SEND_PART = 1 << 20


def send_file(sock: socket.socket, f: BinaryIO, size: int,
              progress: Callable[[int], None] | None = None) -> None:
    """``size`` bytes of ``f`` from its start: by ``sendfile`` on a plain socket (the
    kernel copies, nothing passes through Python), by reads over TLS; ``progress``
    is told each part's length as it goes."""
    done = 0
    while done < size:
        n = min(SEND_PART, size - done)
        sent = sock.sendfile(f, done, n)
        if sent != n:
            raise OSError(f"file ended after {done + sent} of {size} bytes")
        done += n
        if progress is not None:
            progress(n)
