"""sidecar/ops.py, the host side of every small host operation: one request in, one
reply out, a typed error (naming step, host and file) for anything wrong, never an
exception through the seam."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from mtc import errors, layout
from mtc.contract import AgentConfig, decode_reply, encode_request
from mtc.manifest import MANIFEST_NAME, LeafEntry, Manifest, ShardEntry
from mtc.sidecar.ops import HostOps
from mtc.sidecar.storage.deleter import remove_step


def config(root: Path) -> AgentConfig:
    return AgentConfig(local_dir=str(root), host_of_device={0: 0, 1: 1},
                       slice_of_host={0: 0, 1: 0}, subdirs=True, max_staged_bytes=None,
                       writer_threads=1)


def commit(root: Path, host: int, step: int, *, manifest_host: int | None = None) -> None:
    d = root / f"host-{host}" / str(step)
    d.mkdir(parents=True)
    m = Manifest(step=step, host=host if manifest_host is None else manifest_host, slice=0,
                 num_hosts=2, leaves=(), run="r")
    (d / MANIFEST_NAME).write_bytes(m.to_bytes())


def ask(ops: HostOps, op: str, hosts: list[int], **args: object) -> object:
    return decode_reply(ops.handle(encode_request(op, hosts, **args)))


def test_steps_lists_every_reachable_host_root(tmp_path: Path) -> None:
    commit(tmp_path, 0, 5)
    commit(tmp_path, 1, 5)
    commit(tmp_path, 1, 6)
    (tmp_path / "host-1" / "7.mtc-tmp-abc").mkdir()  # uncommitted: never a step
    (tmp_path / "host-9").write_text("a lost host's placeholder, not a folder")
    ops = HostOps(config(tmp_path))
    assert ask(ops, "steps", [0]) == {"0": [5], "1": [5, 6]}


def test_a_manifest_is_checked_where_it_is_and_errors_name_it(tmp_path: Path) -> None:
    commit(tmp_path, 0, 5)
    commit(tmp_path, 1, 5, manifest_host=0)  # a copy of host 0's, in host 1's root
    ops = HostOps(config(tmp_path))
    data = ask(ops, "manifest", [0], step=5)
    assert Manifest.from_bytes(bytes(data)).step == 5  # type: ignore[arg-type]
    with pytest.raises(errors.ManifestError, match="belongs to step 5 host 0") as e:
        ask(ops, "manifest", [1], step=5)
    assert (e.value.step, e.value.host) == (5, 1) and MANIFEST_NAME in str(e.value.path)
    with pytest.raises(errors.ManifestError, match="has no manifest") as e:
        ask(ops, "manifest", [0], step=6)
    assert e.value.step == 6


def test_delete_and_retain_remove_only_what_they_are_told(tmp_path: Path) -> None:
    for s in (1, 2, 3, 4):
        commit(tmp_path, 0, s)
    ops = HostOps(config(tmp_path))
    assert ask(ops, "delete", [0], step=1) is True
    assert ask(ops, "delete", [0], step=1) is False  # already gone
    space = ask(ops, "retain", [0], complete=[2, 3, 4], max_to_keep=2, keep_period=None,
                before_write=False)
    ask(ops, "settle", [0])
    assert ask(ops, "steps", [0]) == {"0": [3, 4]}
    free, newest = space["0"]  # type: ignore[index]
    assert free > 0 and newest > 0


def test_the_newest_steps_bytes_are_its_manifests_sum_without_a_stat_per_file(
        tmp_path: Path, lstats: list[str]) -> None:
    d = tmp_path / "host-0" / "7"
    d.mkdir(parents=True)
    shards = []
    for i, n in enumerate((100, 4096, 7)):
        (d / f"s{i}").write_bytes(bytes(n))
        shards.append(ShardEntry(file=f"s{i}", index=((0, n),), nbytes=n, crc32c=0))
    leaf = LeafEntry(path="x", keys=(("d", "x"),), kind="array", shape=(4203,),
                     dtype="uint8", shards=tuple(shards))
    (d / MANIFEST_NAME).write_bytes(Manifest(step=7, host=0, slice=0, num_hosts=1,
                                             leaves=(leaf,), run="r").to_bytes())
    on_disk = layout.folder_bytes(d)
    lstats.clear()
    _, newest = ask(HostOps(config(tmp_path)), "space", [0])["0"]  # type: ignore[index]
    assert newest == on_disk
    # No shard file stat'd (the manifest's presence is: it makes the step mtc's).
    assert [Path(p).name for p in lstats if Path(p).parent == d] == [MANIFEST_NAME]
    # An unreadable manifest: the folder is measured file by file instead.
    (d / MANIFEST_NAME).write_bytes(b"{}")
    _, newest = ask(HostOps(config(tmp_path)), "space", [0])["0"]  # type: ignore[index]
    assert newest == layout.folder_bytes(d)


NOTHING = {"removed": [], "foreign": [], "identity": "", "manifest_bytes": 0}


def test_open_shares_the_writer_lock_in_a_process_and_only_the_first_cleans(
        tmp_path: Path) -> None:
    """Managers of one process share a root's kernel lock (mtc.root_lock); only the
    first cleans what a crash left: a later one may find the first one writing."""
    from mtc import root_lock

    root = tmp_path / "host-0"
    first, second = HostOps(config(tmp_path)), HostOps(config(tmp_path))
    assert ask(first, "open", [0], lock=True, clean=True) == {"0": NOTHING}
    inflight = root / "6.mtc-tmp-0123456789ab"
    inflight.mkdir()
    assert ask(second, "open", [0], lock=True, clean=True) == {"0": NOTHING}
    assert inflight.is_dir() and root_lock.held_here(root)
    first.release_all()
    assert root_lock.held_here(root) and (root / layout.LOCK_NAME).exists()  # second holds it
    second.release_all()
    assert not root_lock.held_here(root) and not (root / layout.LOCK_NAME).exists()
    third = HostOps(config(tmp_path))
    assert ask(third, "open", [0], lock=True, clean=True)["0"]["removed"] == [inflight.name]
    third.release_all()


def test_open_answers_what_a_manager_needs_in_one_round_trip(tmp_path: Path) -> None:
    """What a crash left is removed, a step folder without mtc's manifest (Orbax's)
    is named and left alone, and the root's identity is written and answered."""
    commit(tmp_path, 0, 5)
    (tmp_path / "host-0" / "7").mkdir()  # another tool's step
    (tmp_path / "host-0" / "6.mtc-tmp-0123456789ab").mkdir()  # a save a crash cut short
    ops = HostOps(config(tmp_path))
    got = ask(ops, "open", [0], lock=True, clean=True, identify=True)
    ops.release_all()
    assert got == {"0": {"removed": ["6.mtc-tmp-0123456789ab"], "foreign": [7],
                         "identity": layout.root_identity(tmp_path / "host-0"),
                         # the newest step's manifest: what a restore's survey brings
                         "manifest_bytes": (tmp_path / "host-0" / "5" / MANIFEST_NAME
                                            ).stat().st_size}}
    assert got["0"]["identity"]  # type: ignore[index]
    assert (tmp_path / "host-0" / "7").is_dir() and (tmp_path / "host-0" / "5").is_dir()
    assert not (tmp_path / "host-0" / "6.mtc-tmp-0123456789ab").exists()
    # A reader: nothing removed, no identity written.
    reader = HostOps(config(tmp_path))
    assert ask(reader, "open", [1], lock=False, clean=False) == {"1": NOTHING}
    assert layout.root_identity(tmp_path / "host-1") == ""


@pytest.mark.parametrize("request_bytes, kind", [
    (b"not json", errors.ProtocolError),
    (json.dumps({"op": "format-disk", "hosts": [0], "args": {}}).encode(), errors.ProtocolError),
    (encode_request("manifest", [0], nope=1), errors.ProtocolError),
])
def test_a_malformed_request_is_a_typed_error(tmp_path: Path, request_bytes: bytes,
                                              kind: type[errors.MtcError]) -> None:
    reply = HostOps(config(tmp_path)).handle(request_bytes)
    with pytest.raises(kind):
        decode_reply(reply)


def test_a_worker_answers_only_for_its_own_host(tmp_path: Path) -> None:
    commit(tmp_path, 1, 5)
    ops = HostOps(config(tmp_path))
    assert decode_reply(ops.handle(encode_request("steps", [1]), serves=[0])) is None
    reply = decode_reply(ops.handle(encode_request("manifest", [1], step=5), serves=[1]))
    assert Manifest.from_bytes(bytes(np.frombuffer(reply, np.uint8))).host == 1  # type: ignore[arg-type]


def test_a_new_managers_clean_up_leaves_a_step_this_process_is_still_writing(
        tmp_path: Path) -> None:
    """A sidecar outlives its trainer: the next trainer's manager cleans up while the
    sidecar may still be writing the killed trainer's last save."""
    from mtc.sidecar.storage.deleter import clean_uncommitted, writing
    from mtc.sidecar.storage.names import tmp_dir

    root = tmp_path / "host-0"
    root.mkdir()
    busy, left = tmp_dir(root, 7), tmp_dir(root, 6)
    busy.mkdir()
    left.mkdir()
    writing(busy, True)
    try:
        assert clean_uncommitted(root) == [left.name]
        assert busy.is_dir() and not left.exists()
    finally:
        writing(busy, False)
    assert clean_uncommitted(root) == [busy.name]


def test_a_survey_parses_an_unchanged_manifest_once_and_checks_the_asked_one_every_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commit(tmp_path, 0, 5)
    commit(tmp_path, 0, 6)
    ops = HostOps(config(tmp_path))
    parsed: list[int] = []
    checked: list[int] = []
    real, real_check = Manifest.summary_of, Manifest.check_bytes

    def counting(data: bytes, *, path: str = "") -> object:
        parsed.append(int(Path(path).parent.name))
        return real(data, path=path)

    def counting_checks(data: bytes, *, path: str = "") -> None:
        checked.append(int(Path(path).parent.name))
        real_check(data, path=path)

    monkeypatch.setattr(Manifest, "summary_of", counting)
    monkeypatch.setattr(Manifest, "check_bytes", counting_checks)
    first = ask(ops, "survey", [0])
    assert sorted(parsed) == [5, 6] and checked == []  # step 6, sent whole, parsed once
    assert first["0"]["facts"] == {"5": [2, "r"], "6": [2, "r"]}  # type: ignore[index]
    parsed.clear()
    # The disk's free space is the machine's (other tests write beside it): the rest
    # of the answer is the same.
    again = ask(ops, "survey", [0])
    for answer in (again, first):
        answer["0"].pop("space")  # type: ignore[union-attr]
    assert again == first
    # The step sent is read and its checksum checked again; nothing is parsed again.
    assert parsed == [] and checked == [6]
    # Its bytes damaged in place with the file's version kept (a bit flip): the
    # checksum tells, and the error is the host's, naming the file.
    path = tmp_path / "host-0" / "6" / MANIFEST_NAME
    st = path.stat()
    raw = bytearray(path.read_bytes())
    at = raw.index(b'\\"step\\":6')  # inside the body text
    raw[at + 9] = ord("7")
    with open(path, "r+b") as f:
        f.write(raw)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_ino, path.stat().st_size, path.stat().st_mtime_ns) == \
        (st.st_ino, st.st_size, st.st_mtime_ns)
    with pytest.raises(errors.ManifestError, match="checksum") as bad:
        ask(ops, "survey", [0], step=6)
    assert (bad.value.step, bad.value.host) == (6, 0) and MANIFEST_NAME in str(bad.value.path)
    remove_step(tmp_path / "host-0", 6)
    commit(tmp_path, 0, 6)  # a good copy back (healed): a new version of the file
    # Replaced (another save under the number): read again, its new facts answered.
    remove_step(tmp_path / "host-0", 5)
    d = tmp_path / "host-0" / "5"
    d.mkdir()
    (d / MANIFEST_NAME).write_bytes(Manifest(step=5, host=0, slice=0, num_hosts=1,
                                             leaves=(), run="s").to_bytes())
    parsed.clear()
    again = ask(ops, "survey", [0])
    assert sorted(parsed) == [5, 6]
    assert again["0"]["facts"]["5"] == [1, "s"]  # type: ignore[index]
    # The step sent is damaged: its error stays the host's, naming the file.
    (tmp_path / "host-0" / "6" / MANIFEST_NAME).write_bytes(b"{}")
    with pytest.raises(errors.ManifestError) as e:
        ask(ops, "survey", [0], step=6)
    assert (e.value.step, e.value.host) == (6, 0) and MANIFEST_NAME in str(e.value.path)


def test_open_keeps_the_first_root_metadata_and_refuses_what_is_not_json_text(
        tmp_path: Path) -> None:
    ops = HostOps(config(tmp_path))
    assert ask(ops, "open", [0], lock=True, clean=True, metadata='{"v": 1}')["0"][
        "metadata"] == '{"v": 1}'
    assert ask(ops, "open", [0], lock=True, clean=True, metadata='{"v": 2}')["0"][
        "metadata"] == '{"v": 1}'  # the first stays, as Orbax's
    for bad in (5, "x" * (layout.ROOT_METADATA_MAX + 1)):
        with pytest.raises(errors.ProtocolError, match="root metadata"):
            ask(ops, "open", [0], lock=True, clean=True, metadata=bad)
    ops.release_all()
