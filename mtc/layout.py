"""Where steps live on a RAM disk, and the commit protocol.

A host root holds committed steps as folders named by the step number. A step
is written into ``<step>.mtc-tmp-<nonce>/`` and becomes visible only through one
atomic rename to ``<step>/``; deletion renames it to ``<step>.mtc-del-<nonce>/``
first, so a crash never leaves a half-deleted folder that looks committed.
Anything that is not a digits-only folder is never read, and mtc's own
leftovers are removed by :func:`clean_uncommitted`. A digits-only folder without
mtc's manifest (an Orbax step in the same folder) is foreign: never listed as a
step, read, replaced or deleted (:func:`is_mtc_step`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import stat
import threading
import uuid
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import numpy as np

from mtc.errors import DirectoryLockedError, InvalidStepError, LocalDirError
from mtc.manifest import MANIFEST_NAME
from mtc.pool import ThreadPool
from mtc.validate import MAX_STEP

TMP_MARK = ".mtc-tmp-"
DEL_MARK = ".mtc-del-"
# One writer per host root: a checkpoint manager holds an exclusive flock on this
# file while it is open. The kernel drops the lock when the process dies, so a
# crash leaves nothing to clean up. Replicators never take it (they write peer
# copies and restored steps beside the manager, by design).
LOCK_NAME = ".mtc-writer.lock"
_STEP_DIGITS = len(str(MAX_STEP))
# A host root's identity: a random token the host side writes once at the root; the
# replicator serving that RAM disk reports what it finds at its --local-dir, so a
# manager and a replicator that do not serve the same folder are told apart at
# start without any path crossing between hosts.
ROOT_ID_NAME = ".mtc-root-id"
ROOT_ID_MAX = 64


def root_identity(root: Path, *, create: bool) -> str:
    """The identity written at ``root`` ("" when none is there); ``create`` writes a
    new one when none is (host side only: a manager's host at start)."""
    path = root / ROOT_ID_NAME
    try:
        with open(path, "rb") as f:
            found = f.read(ROOT_ID_MAX + 1).decode("ascii", "replace").strip()
        if found and len(found) <= ROOT_ID_MAX and found.isalnum():
            return found
    except (FileNotFoundError, NotADirectoryError):
        pass
    if not create:
        return ""
    new = uuid.uuid4().hex
    write_atomic(path, new)
    return root_identity(root, create=False) or new


def as_step(step: Any) -> int:
    """``step`` as a Python int: any integer type (int, numpy integer, a 0-d integer
    array such as a flax ``TrainState.step``); anything else is refused."""
    kind = ""
    if isinstance(step, (bool, np.bool_)):
        kind = "b"
    elif isinstance(step, (int, np.integer)):
        kind = "i"
    elif getattr(step, "shape", None) == ():
        try:
            kind = np.dtype(step.dtype).kind
        except TypeError:  # e.g. a typed PRNG key
            kind = ""
    if kind not in ("i", "u"):
        raise InvalidStepError(f"a step must be a non-negative integer (int, numpy integer or "
                               f"0-d integer array), got {type(step).__name__} {step!r}")
    value = int(np.asarray(step)) if not isinstance(step, int) else int(step)
    if value < 0:
        raise InvalidStepError(f"a step must be a non-negative integer, got {value}")
    if value > MAX_STEP:
        raise InvalidStepError(f"a step must be at most {MAX_STEP}, got {value}")
    return value


def write_atomic(path: Path, data: str | bytes, *, durable: bool = False) -> None:
    """Write ``path`` whole or not at all: a temporary name beside it, then one rename.
    ``durable`` also syncs the bytes first (records that must survive a power loss)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def host_root(local_dir: str | os.PathLike[str], host: int, subdirs: bool) -> Path:
    """The folder holding ``host``'s steps."""
    return Path(local_dir) / f"host-{host}" if subdirs else Path(local_dir)


def step_dir(root: Path, step: int) -> Path:
    return root / str(step)


def new_tmp_dir(root: Path, step: int) -> Path:
    return root / f"{step}{TMP_MARK}{uuid.uuid4().hex[:12]}"


def committed_steps(root: Path) -> list[int]:
    """Committed steps under ``root``, oldest first: folders named by a step number
    (a symlink named so is no step: its files are not the host's), in range."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = (step_of_name(n) for n in names)
    return sorted(s for s in steps if s is not None and _is_real_dir(root / str(s)))


def is_mtc_step(root: Path, step: int) -> bool:
    """Whether the committed folder of ``step`` is mtc's: it holds mtc's manifest,
    which mtc writes before the commit's rename. A step folder without one was
    written by another tool (Orbax's steps in the same folder): it is foreign, and
    mtc never offers, reads, replaces or deletes it."""
    return os.path.lexists(step_dir(root, step) / MANIFEST_NAME)


def mtc_steps(root: Path) -> list[int]:
    """Committed steps under ``root`` that are mtc's (:func:`is_mtc_step`), oldest first."""
    return [s for s in committed_steps(root) if is_mtc_step(root, s)]


def foreign_steps(root: Path) -> list[int]:
    """Step folders under ``root`` that are not mtc's (no manifest), oldest first."""
    return [s for s in committed_steps(root) if not is_mtc_step(root, s)]


def step_of_name(name: str) -> int | None:
    """The step a folder name is, written as :func:`step_dir` writes it (ASCII digits,
    no leading zero, in range); None for any other name."""
    if not (name.isascii() and name.isdigit()) or len(name) > _STEP_DIGITS or \
            (name != "0" and name.startswith("0")):
        return None
    value = int(name)
    return value if value <= MAX_STEP else None


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def commit(tmp: Path, final: Path) -> None:
    """Publish a fully written step folder. Raises FileExistsError if ``final`` exists."""
    # rename(2) onto an existing empty directory would silently succeed; refuse.
    if final.exists():
        raise FileExistsError(str(final))
    os.rename(tmp, final)


_deleter: ThreadPool | None = None  # one per process, for its whole life
_deleting: list[Future[None]] = []
_deleting_lock = threading.Lock()


def lower_thread_priority(by: int = 10) -> None:
    """The calling thread yields the CPU to the training loop and to the requests
    it waits on (Linux: a thread's own nice value, raised by ``by`` over what it
    has, so it holds under a process started with ``nice`` too). Background work
    (host-side writes, deletions) runs at full speed when nothing else wants the CPU."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (OSError, AttributeError):
        pass


def name_native_thread(name: str) -> None:
    """Give the calling thread ``name`` where the OS shows threads (Linux: its
    ``comm``, 15 bytes, as ``top -H`` and ``/proc/<pid>/task/<tid>/comm`` show it):
    Python's thread names stay inside Python, and an operator or a benchmark that
    places or watches threads needs to tell them apart from outside."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_name = 15
        libc.prctl(pr_set_name, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def remove_step(root: Path, step: int, *, background: bool = False) -> bool:
    """Delete a committed step, atomically hiding it first. False if absent.

    With ``background`` the hidden folder is removed on a helper thread: freeing
    a large step takes a noticeable fraction of a second, which a training loop
    should not wait for. Leftovers of a crash are removed by clean_uncommitted.
    """
    global _deleter
    src = step_dir(root, step)
    dst = root / f"{step}{DEL_MARK}{uuid.uuid4().hex[:12]}"
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        return False
    if background:
        with _deleting_lock:
            if _deleter is None:
                try:
                    _deleter = ThreadPool(1, "mtc-delete", initializer=lower_thread_priority)
                except RuntimeError:  # the interpreter is exiting: no new threads
                    background = False
            if _deleter is not None:
                _deleting[:] = [f for f in _deleting if not f.done()]
                _deleting.append(_deleter.submit(shutil.rmtree, dst, ignore_errors=True))
    if not background:
        shutil.rmtree(dst, ignore_errors=True)
    return True


# Temporary step folders a writer of this process is filling: a sidecar outlives
# its trainer, and may still be writing a killed trainer's last save when the next
# trainer's manager cleans up.
_writing: set[Path] = set()
_writing_lock = threading.Lock()


def writing(tmp: Path, busy: bool) -> None:
    """Mark ``tmp`` as being written by this process (``busy``), or no longer."""
    with _writing_lock:
        if busy:
            _writing.add(tmp)
        else:
            _writing.discard(tmp)


def clean_uncommitted(root: Path) -> list[str]:
    """Remove mtc's temporary and half-deleted folders; returns their names. A folder
    a writer of this process is still filling is left to it (it commits or removes it)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    with _writing_lock:
        busy = {p.name for p in _writing if p.parent == root}
    removed = [n for n in names if (TMP_MARK in n or DEL_MARK in n) and n not in busy]
    for n in removed:
        shutil.rmtree(root / n, ignore_errors=True)
    return removed


def finish_deletions() -> None:
    """Wait until every background deletion has freed its space."""
    with _deleting_lock:
        pending = list(_deleting)
    wait(pending)


def free_bytes(root: Path) -> int:
    """Bytes free on the file system holding ``root``."""
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def room(path: Path, reserve: int) -> int:
    """Bytes that may still be written on ``path``'s file system, leaving ``reserve``
    free (at most a sixteenth of it, on a small one)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize - min(reserve, st.f_blocks * st.f_frsize // 16)


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it is gone)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                continue
    return total


def prepare_root(root: Path) -> None:
    """Create a host root; raise LocalDirError naming it when that is impossible."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(root))
    except OSError as e:
        raise LocalDirError(f"cannot use the directory: {e.strerror or e}",
                            path=str(e.filename or root)) from e


def lock_root(root: Path) -> int:
    """Take the writer lock of a host root; returns the descriptor holding it.

    The holder unlinks the file when it lets go (:func:`unlock_root`), so a lock
    taken on a file that was unlinked meanwhile is retried on the new one."""
    path = root / LOCK_NAME
    for _ in range(100):  # each retry means another manager just let go
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise LocalDirError(f"cannot create the lock file: {e.strerror}",
                                path=str(path)) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise DirectoryLockedError(
                f"another checkpoint manager (process {holder}) is using this directory; "
                "close it first, or give each job its own local_dir. Processes of one job on "
                "one machine sharing a local_dir (Orbax's multi-process habit) pass "
                "mtc.Options(host_subdirs=True): each host then keeps its steps in its own "
                "<local_dir>/host-<i>/", path=str(root)) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)
    raise DirectoryLockedError("the writer lock keeps changing hands", path=str(path))


def unlock_root(fd: int, root: Path) -> None:
    """Let go of the writer lock: unlink the file (while holding it), then close."""
    path = root / LOCK_NAME
    try:
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)  # closing the last descriptor of the open file drops the flock


@dataclasses.dataclass(frozen=True)
class RootReport:
    """What a host root holds, for ``mtc status --local-dir``."""

    root: Path
    steps: dict[int, int]        # committed step -> bytes
    leftovers: dict[str, int]    # uncommitted or unknown folders -> bytes
    foreign: dict[int, int] = dataclasses.field(default_factory=dict)
    # step folders without mtc's manifest (Orbax's, another tool's) -> bytes


def inspect_root(root: Path) -> RootReport:
    steps: dict[int, int] = {}
    foreign: dict[int, int] = {}
    leftovers: dict[str, int] = {}
    for name in sorted(os.listdir(root)):
        p = root / name
        if not p.is_dir() or p.is_symlink():
            continue
        step = step_of_name(name)
        if step is not None:
            (steps if is_mtc_step(root, step) else foreign)[step] = folder_bytes(p)
        elif name.isdigit():
            leftovers[name] = folder_bytes(p)
        elif TMP_MARK in name or DEL_MARK in name or not (
                name.startswith("host-") or name.startswith(".")):
            # (dot folders are the replicator's own: peer copies, staging)
            leftovers[name] = folder_bytes(p)
    return RootReport(root, dict(sorted(steps.items())), leftovers,
                      dict(sorted(foreign.items())))
