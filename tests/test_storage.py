"""mtc.sidecar.storage: publish and replace, the temporary names, file checksums,
the spare, and the deleter."""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from mtc import layout
from mtc.errors import CorruptShardError
from mtc.integrity import crc32c
from mtc.sidecar.storage import checksum, names, publish, spare
from mtc.sidecar.storage.deleter import Deleter, clean_uncommitted, remove_step, writing


def _make(path: Path, kind: str) -> None:
    if kind == "file":
        path.write_bytes(b"held")
    elif kind == "empty folder":
        path.mkdir()
    elif kind == "folder":
        path.mkdir()
        (path / "f").write_bytes(b"held")
    elif kind == "symlink":
        os.symlink("elsewhere", path)  # dangling: exists() says no, lexists() yes
    else:
        assert kind == "nothing"


@pytest.fixture(params=["renameat2", "fallback"])
def noreplace(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each publish test runs with renameat2 and with the check-then-rename a file
    system without RENAME_NOREPLACE falls back to."""
    if request.param == "fallback":
        monkeypatch.setattr(publish, "_renameat2", None)
    elif publish._renameat2 is None:
        pytest.skip("no renameat2 in this C library")
    return str(request.param)


# What is at the target -> whether a publish there succeeds (rename(2) alone would
# replace a file, an empty folder and a symlink).
PUBLISH = [("nothing", True), ("file", False), ("empty folder", False), ("folder", False),
           ("symlink", False)]


@pytest.mark.parametrize(("there", "ok"), PUBLISH)
@pytest.mark.parametrize("src_kind", ["file", "folder"])
def test_publish_refuses_any_target_that_exists(tmp_path: Path, noreplace: str, there: str,
                                                ok: bool, src_kind: str) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _make(src, src_kind)
    _make(dst, there)
    if ok:
        publish.publish(src, dst)
        assert not os.path.lexists(src) and os.path.lexists(dst)
        return
    with pytest.raises(FileExistsError):
        publish.publish(src, dst)
    assert os.path.lexists(src)  # nothing moved, nothing lost
    if there in ("file", "folder"):
        assert (dst.read_bytes() if there == "file" else (dst / "f").read_bytes()) == b"held"


def test_publish_and_replace_through_folder_descriptors(tmp_path: Path, noreplace: str) -> None:
    (tmp_path / "a").write_bytes(b"1")
    (tmp_path / "b").write_bytes(b"2")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FileExistsError):
            publish.publish("a", "b", src_dir_fd=fd, dst_dir_fd=fd)
        publish.publish("a", "c", src_dir_fd=fd, dst_dir_fd=fd, durable=True)
        publish.replace("c", "b", dst_dir_fd=fd, src_dir_fd=fd)
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == ["b"] and (tmp_path / "b").read_bytes() == b"1"


def test_replace_takes_the_name_whatever_holds_it(tmp_path: Path) -> None:
    (tmp_path / "new").write_bytes(b"new")
    (tmp_path / "old").write_bytes(b"old")
    publish.replace(tmp_path / "new", tmp_path / "old")
    assert (tmp_path / "old").read_bytes() == b"new" and not (tmp_path / "new").exists()


@pytest.mark.parametrize("durable", [False, True])
def test_durable_renames_sync_the_file_and_both_folders(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool) -> None:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    publish.write_atomic(tmp_path / "a" / "rec", "x", durable=durable)
    tmp_name = next(iter(synced), "")
    publish.publish(tmp_path / "a" / "rec", tmp_path / "b" / "rec", durable=durable)
    if not durable:
        assert synced == []
        return
    # The bytes (under their temporary name), the folder of the rename; then both
    # folders of a rename between them.
    assert names.is_tmp(Path(tmp_name).name) and Path(tmp_name).parent == tmp_path / "a"
    assert synced[1:] == [str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "a")]


def test_write_atomic_leaves_nothing_behind_when_it_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    publish.write_atomic(tmp_path / "rec", "old")

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="No space"):
        publish.write_atomic(tmp_path / "rec", "new")
    assert os.listdir(tmp_path) == ["rec"] and (tmp_path / "rec").read_text() == "old"


def test_renameat2_is_seen_by_audit_hooks_as_a_rename(tmp_path: Path,
                                                      noreplace: str) -> None:
    """The seam audit (tests/seam_audit.py) watches os.rename events; a rename made
    through ctypes must raise the same one."""
    seen: list[tuple[Any, ...]] = []
    watching = [True]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if watching[0] and event == "os.rename":
            seen.append(args[:2])

    sys.addaudithook(hook)  # hooks stay for the session: this one stops recording
    try:
        (tmp_path / "a").write_bytes(b"")
        publish.publish(tmp_path / "a", tmp_path / "b")
    finally:
        watching[0] = False
    assert (str(tmp_path / "a"), str(tmp_path / "b")) in [tuple(map(os.fsdecode, s)) for s in seen]


# name -> (is_tmp, tmp_step)
NAMES = [("7", False, None), ("7.mtc-tmp-0123456789ab", True, 7),
         (".rec.mtc-tmp-0123456789ab", True, None), ("7.mtc-del-0123456789ab", False, None),
         ("x.mtc-tmp-1", True, None), ("07a.mtc-tmp-1", True, None), ("rec.part", False, None)]


@pytest.mark.parametrize(("name", "tmp", "step"), NAMES)
def test_temporary_names_are_told_from_others(name: str, tmp: bool, step: int | None) -> None:
    assert names.is_tmp(name) == tmp
    assert names.tmp_step(name) == step
    assert layout.step_of_name(name) == (7 if name == "7" else None)


def test_names_made_are_unique_hidden_and_never_steps(tmp_path: Path) -> None:
    made = [names.tmp_name(tmp_path / "rec"), names.tmp_dir(tmp_path, 7),
            names.deleted_dir(tmp_path, "7"), names.partial_name(tmp_path / "rec"),
            names.aside_name(tmp_path / "rec", "corrupt")]
    assert all(p.parent == tmp_path and layout.step_of_name(p.name) is None for p in made)
    assert made[0].name.startswith(".rec") and names.is_tmp(made[0].name)
    assert names.tmp_step(made[1].name) == 7
    assert layout.DEL_MARK in made[2].name and made[3].name == "rec.part"
    assert names.tmp_dir(tmp_path, 7) != made[1]  # two writers never share one


def test_clean_uncommitted_removes_leftovers_but_not_what_is_being_written(
        tmp_path: Path) -> None:
    busy, left = names.tmp_dir(tmp_path, 7), names.tmp_dir(tmp_path, 6)
    hidden = names.deleted_dir(tmp_path, "5")
    for d in (busy, left, hidden, tmp_path / "5"):
        d.mkdir()
    writing(busy, True)
    try:
        assert sorted(clean_uncommitted(tmp_path)) == sorted([left.name, hidden.name])
    finally:
        writing(busy, False)
    assert sorted(os.listdir(tmp_path)) == sorted(["5", busy.name])
    assert clean_uncommitted(tmp_path) == [busy.name]
    assert clean_uncommitted(tmp_path / "gone") == []


KNOWN = [(b"", 0), (b"123456789", 0xE3069283), (b"\x00" * 32, 0x8A9136AA)]  # RFC 3720 B.4


@pytest.mark.parametrize(("data", "want"), KNOWN)
@pytest.mark.parametrize("chunk", [1, 4, 7, 4096, checksum.CHUNK])
def test_file_crc_is_the_known_crc32c_whatever_the_chunk(tmp_path: Path, data: bytes,
                                                         want: int, chunk: int) -> None:
    path = tmp_path / "f"
    path.write_bytes(data)
    assert checksum.file_crc(path, chunk) == (len(data), want)


# (size, chunk): a last read short of a chunk, exactly a chunk, one byte over.
SIZES = [(0, 3), (1, 3), (4097, 3), (4097, 4097), (checksum.CHUNK - 1, 1 << 16),
         (checksum.CHUNK, checksum.CHUNK), (checksum.CHUNK + 1, checksum.CHUNK)]


@pytest.mark.parametrize(("size", "chunk"), SIZES)
def test_file_crc_matches_the_crc_of_the_bytes(tmp_path: Path, size: int, chunk: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert checksum.file_crc(path, chunk) == (size, crc32c(data))


def test_copy_verified_refuses_a_copy_that_does_not_match(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"123456789")
    assert checksum.copy_verified(src, tmp_path / "ok", 9, 0xE3069283) in ("copy", "reflink")
    with pytest.raises(CorruptShardError, match="crc32c"):
        checksum.copy_verified(src, tmp_path / "bad", 9, 0xE3069284)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(FileExistsError):  # a new file only
        checksum.copy_verified(src, tmp_path / "ok", 9, 0xE3069283)


# (bytes free, file system size, spare) -> room
ROOM = [(1000 << 20, 100 << 30, 64 << 20, 936 << 20),
        (10 << 20, 100 << 30, 64 << 20, -(54 << 20)),  # the spare eaten into
        (8 << 20, 16 << 20, 64 << 20, 7 << 20),  # a small one keeps a sixteenth
        (8 << 20, 16 << 20, 0, 8 << 20)]


@pytest.mark.parametrize(("free", "size", "keep", "want"), ROOM)
def test_room_leaves_the_spare(monkeypatch: pytest.MonkeyPatch, free: int, size: int,
                               keep: int, want: int) -> None:
    class Stat:
        f_frsize = 4096
        f_bavail = free // 4096
        f_blocks = size // 4096

    # A mock: no file system of each size is at hand.
    monkeypatch.setattr(os, "statvfs", lambda path: Stat)
    assert spare.room(Path("/"), keep) == want
    assert spare.free_bytes(Path("/")) == free


def _step(root: Path, step: int) -> Path:
    d = root / str(step)
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "f").write_bytes(b"x" * 1000)
    return d


def test_remove_step_hides_first_then_removes(tmp_path: Path) -> None:
    _step(tmp_path, 3)
    assert remove_step(tmp_path, 3) and os.listdir(tmp_path) == []
    assert not remove_step(tmp_path, 3)


def test_a_deleter_removes_in_the_background_and_close_joins_its_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = shutil.rmtree

    def held(path: str, ignore_errors: bool = False) -> None:
        assert gate.wait(10)
        real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", held)
    before = set(threading.enumerate())
    deleter = Deleter("test-delete")
    for s in (1, 2):
        _step(tmp_path, s)
        assert remove_step(tmp_path, s, deleter)
    # Hidden at once: no step is listed while its files are still going.
    assert layout.committed_steps(tmp_path) == []
    assert len(os.listdir(tmp_path)) == 2
    started = set(threading.enumerate()) - before
    assert [t.name for t in started] == ["test-delete_0"]
    gate.set()
    deleter.settle()
    assert os.listdir(tmp_path) == []
    deleter.close()
    assert not any(t.is_alive() for t in started)
    # Closed: a removal runs in the caller's thread, none starts again.
    _step(tmp_path, 4)
    assert remove_step(tmp_path, 4, deleter) and os.listdir(tmp_path) == []
    assert set(threading.enumerate()) - before == set()


def test_close_waits_for_the_removals_under_way(tmp_path: Path) -> None:
    with Deleter() as deleter:
        for s in range(5):
            _step(tmp_path, s)
            remove_step(tmp_path, s, deleter)
    assert os.listdir(tmp_path) == []


REPO = Path(__file__).resolve().parents[1]


def _renames_and_crcs(path: Path) -> list[str]:
    """Where ``path`` renames a file itself, or defines a file checksum of its own."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef) and "crc" in node.name and "file" in node.name:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} def {node.name}")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
        name = node.func.attr
        if (owner in ("os", "shutil") and name in ("rename", "replace", "renames", "move")) \
                or name == "rename" \
                or (name == "replace" and len(node.args) == 1 and not node.keywords):
            # (str.replace takes two arguments; Path.replace one)
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {owner or '...'}.{name}")
    return found


def test_library_code_renames_and_checksums_files_only_through_storage() -> None:
    storage = REPO / "sidecar" / "storage"
    # mtc.testing is the harness users get, not the data path: the local cluster
    # writes its own state file (cluster.json) whole, as the tests' harness does.
    harness = REPO / "mtc" / "testing"
    found = [f for top in ("mtc", "sidecar") for p in sorted((REPO / top).rglob("*.py"))
             if storage not in p.parents and harness not in p.parents and "_pb2" not in p.name
             for f in _renames_and_crcs(p)]
    assert found == []
    # The check finds what it looks for.
    assert len(_renames_and_crcs(storage / "publish.py")) == 2  # os.rename, os.replace
    assert [f.split()[-1] for f in _renames_and_crcs(storage / "checksum.py")] == ["file_crc"]
