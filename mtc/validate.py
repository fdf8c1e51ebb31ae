"""What a number or a path from the network or the host seam may be: checked where it
arrives, before any I/O, on both sides of the seam (JAX-free, imports only errors).

Bounds, and why:

- a step and an epoch are integers in ``0..MAX_STEP``: JSON carries them (manifests,
  requests, agreement records) and a JSON reader that uses doubles, as most
  languages' do, reads a larger integer wrong; the replicators' protobufs are int64,
  and a step one below 2^63 would overflow the first ``+ 1`` made of it;
- a file has at most ``MAX_FILE_BYTES`` (1 PiB, far above any RAM disk);
- a path is ``/``-separated, relative, without ``.``/``..``/empty parts, NUL or
  backslash, at most ``MAX_PATH_BYTES`` long with parts of at most
  ``MAX_NAME_BYTES`` (Linux refuses longer names with an error that would name
  the server's own folders).
"""

from __future__ import annotations

from typing import Any

from mtc.errors import InvalidStepError, ProtocolError, UnsafePathError

MAX_STEP = 2**53 - 1
MAX_EPOCH = 2**53 - 1
MAX_FILE_BYTES = 2**50
MAX_PATH_BYTES = 1024
MAX_NAME_BYTES = 255
MAX_ID_CHARS = 256  # restore ids, transfer ids


def is_int(x: Any) -> bool:
    """A real integer (JSON's and protobuf's): not a bool, not a float."""
    return isinstance(x, int) and not isinstance(x, bool)


def step(x: Any, *, what: str = "step", host: int | None = None) -> int:
    """``x`` as a step number, or :class:`InvalidStepError` naming it."""
    if not is_int(x) or not 0 <= x <= MAX_STEP:
        raise InvalidStepError(f"{what} must be an integer in 0..{MAX_STEP}, got "
                               f"{type(x).__name__} {_short(x)}", host=host)
    return int(x)


def epoch(x: Any) -> int:
    if not is_int(x) or not 0 <= x <= MAX_EPOCH:
        raise ProtocolError(f"epoch must be an integer in 0..{MAX_EPOCH}, got {_short(x)}")
    return int(x)


def count(x: Any, what: str, hi: int, *, lo: int = 0) -> int:
    """An integer field in ``lo..hi`` (a rank, a size, an offset)."""
    if not is_int(x) or not lo <= x <= hi:
        raise ProtocolError(f"{what} must be an integer in {lo}..{hi}, got {_short(x)}")
    return int(x)


def file_size(x: Any, *, path: str | None = None) -> int:
    if not is_int(x) or not 0 <= x <= MAX_FILE_BYTES:
        raise ProtocolError(f"file size must be in 0..{MAX_FILE_BYTES}, got {_short(x)}",
                            path=path)
    return int(x)


def relpath(path: Any) -> str:
    """A ``/``-separated relative path from a request or a peer, or
    :class:`UnsafePathError`. Only the string is checked: whoever opens it still
    refuses symlinks (:mod:`mtc.sidecar.confine`)."""
    if not isinstance(path, str) or not path:
        raise UnsafePathError(f"refusing path {_short(path)}")
    if len(path.encode(errors="surrogatepass")) > MAX_PATH_BYTES:
        raise UnsafePathError(f"refusing a path of {len(path)} characters "
                              f"(at most {MAX_PATH_BYTES} bytes): {_short(path)}")
    if "\x00" in path or path.startswith("/") or "\\" in path:
        raise UnsafePathError(f"refusing path {_short(path)}")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"refusing path {_short(path)}")
    if any(len(p.encode(errors="surrogatepass")) > MAX_NAME_BYTES for p in parts):
        raise UnsafePathError(f"refusing path {_short(path)}: a part is longer than "
                              f"{MAX_NAME_BYTES} bytes")
    return path


def ident(x: Any, what: str) -> str:
    """A short opaque id (restore id, transfer id)."""
    if not isinstance(x, str) or len(x) > MAX_ID_CHARS:
        raise ProtocolError(f"{what} must be a string of at most {MAX_ID_CHARS} characters, "
                            f"got {_short(x)}")
    return x


def _short(x: Any) -> str:
    """A value for an error message: never the whole of a huge one."""
    r = repr(x)
    return r if len(r) <= 80 else f"{r[:60]}...({len(r)} characters)"
