"""Backup storage backends: local folder, fsspec (memory://), and GCS through the real
fake-gcs-server emulator, with a fault-injecting proxy and a Storage Control API double
(see tests/gcs_fakes.py). Every double is started here; nothing outside is needed."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
import pytest
from gcs_fakes import Emulator, FakeStorageControl, FaultProxy, free_port

from mtc.errors import StepExistsError
from mtc.integrity import crc32c
from mtc.sidecar.backup.backend import BackupUnavailableError, CorruptBackupError, open_backend
from mtc.sidecar.backup.fsspec_backend import FsspecBackend
from mtc.sidecar.backup.gcs import GcsBackend, crc_b64
from mtc.sidecar.backup.local import LocalBackend

MiB = 1 << 20
# Retry quickly and give up within seconds, so failure tests take seconds, not minutes.
FAST: dict[str, Any] = dict(deadline=3.0, initial_backoff=0.05, max_backoff=0.2,
                            timeout=(2.0, 10.0))


def make_file(path: Path, size: int, seed: int = 0) -> tuple[int, int]:
    data = (seed.to_bytes(4, "little") + os.urandom(64)) * (size // 68 + 1)
    data = data[:size]
    path.write_bytes(data)
    return size, crc32c(data)


# -- fixtures --------------------------------------------------------------------


@pytest.fixture(scope="session")
def emulator() -> Iterator[Emulator]:
    emu = Emulator()
    try:
        yield emu
    finally:
        emu.stop()


@pytest.fixture
def bucket(emulator: Emulator, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; STORAGE_EMULATOR_HOST points at the emulator for this test."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.url)
    name = f"b-{uuid.uuid4().hex[:12]}"
    emulator.client().create_bucket(name)
    return name


@pytest.fixture
def proxy(emulator: Emulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A fault-injecting proxy; clients built in the test go through it."""
    px = FaultProxy(emulator.port)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", px.url)
    try:
        yield px
    finally:
        px.close()


# -- local folder ----------------------------------------------------------------


def test_local_round_trip_and_publish(tmp_path: Path) -> None:
    store = open_backend(f"file://{tmp_path}/store")
    assert isinstance(store, LocalBackend)
    src = tmp_path / "src.bin"
    size, crc = make_file(src, 3 * MiB + 17)
    store.put_file(src, "staging/1-x/data/0/a.bin", size=size, crc32c=crc)
    store.put_bytes("staging/1-x/MANIFEST.json", b"{}")
    # A crashed writer's temporary file is not a key, but delete_prefix clears it.
    (tmp_path / "store/staging/1-x/.b.mtc-tmp-123").write_bytes(b"junk")
    assert store.list("staging/") == ["staging/1-x/MANIFEST.json", "staging/1-x/data/0/a.bin"]
    assert store.can_publish()
    assert store.publish("staging/1-x", "steps/1") is True
    assert store.list("staging/") == []
    assert store.list("steps/1/") == ["steps/1/MANIFEST.json", "steps/1/data/0/a.bin"]
    out = tmp_path / "out.bin"
    store.get_file("steps/1/data/0/a.bin", out, size=size, crc32c=crc)
    assert out.read_bytes() == src.read_bytes()
    assert store.get_bytes("steps/1/MANIFEST.json") == b"{}"
    assert store.get_bytes("steps/2/MANIFEST.json") is None
    # A second publish onto a committed step is refused, the staging copy left alone.
    store.put_bytes("staging/1-y/MANIFEST.json", b"{}")
    with pytest.raises(StepExistsError):
        store.publish("staging/1-y", "steps/1")
    store.delete_prefix("staging/")
    store.delete_prefix("steps/1/")
    assert store.list("") == []
    assert not (tmp_path / "store/steps/1").exists()
    with pytest.raises(ValueError):
        store.put_bytes("../escape", b"x")


def test_local_detects_corruption(tmp_path: Path) -> None:
    store = LocalBackend(str(tmp_path / "store"))
    src = tmp_path / "src.bin"
    size, crc = make_file(src, MiB)
    # The local file does not match the CRC32C it should have: nothing is stored.
    with pytest.raises(CorruptBackupError):
        store.put_file(src, "k/a", size=size, crc32c=crc ^ 1)
    assert store.list("") == []
    assert os.listdir(tmp_path / "store/k") == []
    store.put_file(src, "k/a", size=size, crc32c=crc)
    stored = tmp_path / "store/k/a"
    data = bytearray(stored.read_bytes())
    data[1000] ^= 0xFF
    stored.write_bytes(bytes(data))
    out = tmp_path / "out.bin"
    with pytest.raises(CorruptBackupError):
        store.get_file("k/a", out, size=size, crc32c=crc)
    assert not out.exists()
    with pytest.raises(CorruptBackupError, match="missing"):
        store.get_file("k/none", out, size=size, crc32c=crc)


# -- fsspec (memory://) -----------------------------------------------------------


@pytest.fixture
def memory_store() -> Iterator[FsspecBackend]:
    url = f"memory://mtc-test-{uuid.uuid4().hex[:8]}/root"
    store = open_backend(url)
    assert isinstance(store, FsspecBackend)
    yield store
    store.delete_prefix("")


def test_fsspec_round_trip(memory_store: FsspecBackend, tmp_path: Path) -> None:
    store = memory_store
    src = tmp_path / "src.bin"
    size, crc = make_file(src, 2 * MiB + 5)
    store.put_file(src, "steps/3/data/0/a", size=size, crc32c=crc)
    store.put_bytes("steps/3/MANIFEST.json", b'{"v": 1}')
    store.put_bytes("steps/30/MANIFEST.json", b"{}")
    assert store.list("steps/3/") == ["steps/3/MANIFEST.json", "steps/3/data/0/a"]
    assert len(store.list("steps/3")) == 3
    assert store.get_bytes("steps/3/MANIFEST.json") == b'{"v": 1}'
    assert store.get_bytes("steps/4/MANIFEST.json") is None
    out = tmp_path / "out.bin"
    store.get_file("steps/3/data/0/a", out, size=size, crc32c=crc)
    assert out.read_bytes() == src.read_bytes()
    # A partial download is resumed; a partial file of other bytes is thrown away.
    for partial in (src.read_bytes()[: MiB], b"\0" * MiB):
        out.unlink()
        Path(f"{out}.part").write_bytes(partial)
        store.get_file("steps/3/data/0/a", out, size=size, crc32c=crc)
        assert out.read_bytes() == src.read_bytes()
        assert not Path(f"{out}.part").exists()
    assert not store.can_publish() and store.publish("steps/3", "steps/4") is False
    store.delete_prefix("steps/3/")
    assert store.list("") == ["steps/30/MANIFEST.json"]


def test_fsspec_detects_corruption(memory_store: FsspecBackend, tmp_path: Path) -> None:
    store = memory_store
    src = tmp_path / "src.bin"
    size, crc = make_file(src, MiB)
    with pytest.raises(CorruptBackupError):
        store.put_file(src, "k/a", size=size, crc32c=crc ^ 1)
    assert store.list("") == []
    store.put_file(src, "k/a", size=size, crc32c=crc)
    fs = fsspec.filesystem("memory")
    fs.pipe_file(store._path("k/a"), b"x" * size)  # same size, other bytes
    out = tmp_path / "out.bin"
    with pytest.raises(CorruptBackupError):
        store.get_file("k/a", out, size=size, crc32c=crc)
    assert not out.exists()
    with pytest.raises(CorruptBackupError, match="missing"):
        store.get_file("k/none", out, size=size, crc32c=crc)


# -- GCS through the emulator -------------------------------------------------------


@pytest.mark.process  # the GCS emulator
def test_gcs_round_trip(bucket: str, emulator: Emulator, tmp_path: Path) -> None:
    store = open_backend(f"gs://{bucket}/backups")
    assert isinstance(store, GcsBackend)
    store = GcsBackend(f"gs://{bucket}/backups", chunk_size=8 * MiB, **FAST)
    small, large = tmp_path / "small", tmp_path / "large"
    s_size, s_crc = make_file(small, 1000, seed=1)
    l_size, l_crc = make_file(large, 20 * MiB + 3, seed=2)  # resumable, 3 chunks
    store.put_file(small, "steps/1/data/0/small", size=s_size, crc32c=s_crc)
    store.put_file(large, "steps/1/data/0/large", size=l_size, crc32c=l_crc)
    store.put_bytes("steps/1/MANIFEST.json", b"{}")
    blob = emulator.client().bucket(bucket).get_blob("backups/steps/1/data/0/large")
    assert blob is not None and blob.size == l_size and blob.crc32c == crc_b64(l_crc)
    assert store.list("steps/") == ["steps/1/MANIFEST.json", "steps/1/data/0/large",
                                    "steps/1/data/0/small"]
    for name, size, crc in (("small", s_size, s_crc), ("large", l_size, l_crc)):
        out = tmp_path / f"{name}.out"
        store.get_file(f"steps/1/data/0/{name}", out, size=size, crc32c=crc)
        assert out.read_bytes() == (tmp_path / name).read_bytes()
    assert store.get_bytes("steps/1/MANIFEST.json") == b"{}"
    assert store.get_bytes("steps/2/MANIFEST.json") is None
    assert store.can_publish() is False  # an emulator has no Storage Control API
    assert store.publish("steps/1", "steps/2") is False
    store.delete_prefix("steps/1/")
    assert store.list("") == []


@pytest.mark.process  # the GCS emulator
def test_gcs_crc_verification(bucket: str, emulator: Emulator, tmp_path: Path) -> None:
    store = GcsBackend(f"gs://{bucket}", chunk_size=8 * MiB, **FAST)
    admin = emulator.client().bucket(bucket)
    for size in (4096, 9 * MiB):  # one request, and resumable
        src = tmp_path / f"f{size}"
        size, crc = make_file(src, size)
        # A local file that does not match its manifest's CRC32C leaves no object.
        with pytest.raises(CorruptBackupError):
            store.put_file(src, f"bad/{size}", size=size, crc32c=crc ^ 1)
        assert admin.get_blob(f"bad/{size}") is None
        store.put_file(src, f"ok/{size}", size=size, crc32c=crc)
        # Someone overwrites the object: the download does not verify.
        admin.blob(f"ok/{size}").upload_from_string(os.urandom(size))
        out = tmp_path / "out"
        with pytest.raises(CorruptBackupError):
            store.get_file(f"ok/{size}", out, size=size, crc32c=crc)
        assert not out.exists() and not Path(f"{out}.part").exists()
    with pytest.raises(CorruptBackupError, match="missing"):
        store.get_file("ok/none", tmp_path / "none", size=1, crc32c=0)


@pytest.mark.process  # the GCS emulator
def test_gcs_resumes_partial_download(bucket: str, proxy: FaultProxy, tmp_path: Path) -> None:
    store = GcsBackend(f"gs://{bucket}", chunk_size=8 * MiB, **FAST)
    src = tmp_path / "src"
    size, crc = make_file(src, 12 * MiB)
    store.put_file(src, "a", size=size, crc32c=crc)
    out = tmp_path / "out"
    Path(f"{out}.part").write_bytes(src.read_bytes()[: 5 * MiB])
    proxy.requests.clear()
    store.get_file("a", out, size=size, crc32c=crc)
    assert out.read_bytes() == src.read_bytes()
    assert [r for _, _, r in proxy.requests if r] == [f"bytes={5 * MiB}-"]
    # A partial file of other bytes: the resumed result fails the CRC and is refetched.
    out.unlink()
    Path(f"{out}.part").write_bytes(b"\0" * (5 * MiB))
    store.get_file("a", out, size=size, crc32c=crc)
    assert out.read_bytes() == src.read_bytes()


@pytest.mark.process  # the GCS emulator
def test_gcs_download_cut_midway(bucket: str, proxy: FaultProxy, tmp_path: Path) -> None:
    store = GcsBackend(f"gs://{bucket}", **FAST)
    src = tmp_path / "src"
    size, crc = make_file(src, 12 * MiB)
    store.put_file(src, "a", size=size, crc32c=crc)
    out = tmp_path / "out"
    # The connection dies halfway: the download goes on from where it stopped.
    proxy.cut_downloads = 1
    proxy.requests.clear()
    store.get_file("a", out, size=size, crc32c=crc)
    assert proxy.cut == 1 and out.read_bytes() == src.read_bytes()
    assert [r for _, _, r in proxy.requests if r] == [f"bytes={6 * MiB}-"]
    # A caller that gives up at once (as a killed restore would): what arrived is kept,
    # and the next call resumes it.
    out.unlink()
    impatient = GcsBackend(f"gs://{bucket}", deadline=0.01, timeout=(2.0, 10.0))
    proxy.cut_downloads = 1
    with pytest.raises(BackupUnavailableError):
        impatient.get_file("a", out, size=size, crc32c=crc)
    kept = Path(f"{out}.part").stat().st_size
    assert kept == 6 * MiB and not out.exists()
    proxy.requests.clear()
    store.get_file("a", out, size=size, crc32c=crc)
    assert out.read_bytes() == src.read_bytes()
    assert [r for _, _, r in proxy.requests if r] == [f"bytes={kept}-"]


@pytest.mark.process  # the GCS emulator
def test_gcs_unreachable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
    # Every call is refused at once and retried until its deadline: waited out four
    # times, so a short one.
    store = GcsBackend("gs://nowhere/x", deadline=0.5, initial_backoff=0.05, max_backoff=0.2,
                       timeout=(1.0, 2.0))
    src = tmp_path / "src"
    size, crc = make_file(src, 1000)
    t0 = time.monotonic()
    with pytest.raises(BackupUnavailableError):
        store.put_file(src, "a", size=size, crc32c=crc)
    with pytest.raises(BackupUnavailableError):
        store.get_file("a", tmp_path / "out", size=size, crc32c=crc)
    with pytest.raises(BackupUnavailableError):
        store.get_bytes("a")
    with pytest.raises(BackupUnavailableError):
        store.list("")
    assert time.monotonic() - t0 < 20


@pytest.mark.process  # the GCS emulator
def test_gcs_retries_5xx(bucket: str, proxy: FaultProxy, tmp_path: Path) -> None:
    store = GcsBackend(f"gs://{bucket}", chunk_size=8 * MiB, **FAST)
    src = tmp_path / "src"
    size, crc = make_file(src, 10 * MiB)
    proxy.fail_next = 3
    store.put_file(src, "a", size=size, crc32c=crc)
    proxy.fail_next = 2
    store.put_bytes("m", b"manifest")
    proxy.fail_next = 3
    store.get_file("a", tmp_path / "out", size=size, crc32c=crc)
    assert (tmp_path / "out").read_bytes() == src.read_bytes()
    proxy.fail_next = 2
    assert store.list("") == ["a", "m"]
    assert proxy.failed == 10
    proxy.fail_always = True
    # Every try fails: each call retries until its deadline (waited out), a short one.
    store = GcsBackend(f"gs://{bucket}", chunk_size=8 * MiB, **{**FAST, "deadline": 0.5})
    t0 = time.monotonic()
    with pytest.raises(BackupUnavailableError):
        store.put_bytes("m2", b"x")
    with pytest.raises(BackupUnavailableError):
        store.get_bytes("m")
    assert proxy.failed > 10 + 2  # retried, not failed at the first answer
    assert time.monotonic() - t0 < 20


@pytest.mark.process  # the GCS emulator
def test_gcs_upload_killed_midway(bucket: str, proxy: FaultProxy, emulator: Emulator,
                                  tmp_path: Path) -> None:
    store = GcsBackend(f"gs://{bucket}", chunk_size=8 * MiB, **FAST)
    admin = emulator.client().bucket(bucket)
    src = tmp_path / "src"
    size, crc = make_file(src, 20 * MiB)
    # One chunk's connection dies after 3 MiB: the chunk is sent again, the upload ends.
    proxy.drop_uploads, proxy.drop_after = 1, 3 * MiB
    store.put_file(src, "once", size=size, crc32c=crc)
    assert proxy.dropped == 1
    store.get_file("once", tmp_path / "once", size=size, crc32c=crc)
    # Every chunk dies: the upload gives up, and no partial object is visible...
    proxy.drop_uploads = -1
    with pytest.raises(BackupUnavailableError):
        store.put_file(src, "again", size=size, crc32c=crc)
    assert admin.get_blob("again") is None
    # ...until the store is healthy and the caller tries again.
    proxy.drop_uploads = 0
    store.put_file(src, "again", size=size, crc32c=crc)
    blob = admin.get_blob("again")
    assert blob is not None and blob.size == size and blob.crc32c == crc_b64(crc)


@pytest.mark.process  # the GCS emulator
def test_gcs_parallel_uploads(bucket: str, tmp_path: Path) -> None:
    store = GcsBackend(f"gs://{bucket}/p", chunk_size=8 * MiB, **FAST)
    files = []
    for i in range(16):
        p = tmp_path / f"f{i}"
        files.append((p, *make_file(p, (i + 1) * 256 * 1024, seed=i)))

    def roundtrip(item: tuple[Path, int, int]) -> bool:
        p, size, crc = item
        store.put_file(p, f"d/{p.name}", size=size, crc32c=crc)
        out = tmp_path / f"{p.name}.out"
        store.get_file(f"d/{p.name}", out, size=size, crc32c=crc)
        return out.read_bytes() == p.read_bytes()

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(roundtrip, files))
    assert len(store.list("d/")) == 16


# -- HNS: Storage Control API --------------------------------------------------------


@pytest.fixture
def control(emulator: Emulator, bucket: str) -> Iterator[FakeStorageControl]:
    fake = FakeStorageControl(emulator, hns={bucket})
    try:
        yield fake
    finally:
        fake.stop()


@pytest.mark.process  # the GCS emulator
def test_gcs_publish_renames_folder_on_hns(bucket: str, control: FakeStorageControl,
                                           tmp_path: Path) -> None:
    store = GcsBackend(f"gs://{bucket}/backups", control_endpoint=control.endpoint, **FAST)
    src = tmp_path / "src"
    size, crc = make_file(src, 100_000)
    store.put_file(src, "staging/7-ab/data/0/a", size=size, crc32c=crc)
    store.put_bytes("staging/7-ab/MANIFEST.json", b"{}")
    assert store.can_publish() is True
    assert store.publish("staging/7-ab", "steps/7") is True
    assert ("RenameFolder", "backups/staging/7-ab/ -> backups/steps/7/") in control.calls
    assert ("CreateFolder", "backups/steps/") in control.calls  # the new parent folder
    assert store.list("staging/") == []
    assert store.list("steps/") == ["steps/7/MANIFEST.json", "steps/7/data/0/a"]
    store.get_file("steps/7/data/0/a", tmp_path / "out", size=size, crc32c=crc)
    # The layout was asked once and cached.
    assert sum(c[0] == "GetStorageLayout" for c in control.calls) == 1
    # Publishing onto a step that has objects is refused.
    store.put_bytes("staging/7-cd/MANIFEST.json", b"{}")
    with pytest.raises(StepExistsError):
        store.publish("staging/7-cd", "steps/7")
    # delete_prefix removes the objects and the folders they leave behind, so the
    # same step can be published again.
    store.delete_prefix("steps/7/")
    assert not {f for f in control.folders[bucket] if f.startswith("backups/steps/7/")}
    assert store.publish("staging/7-cd", "steps/7") is True
    assert store.list("") == ["steps/7/MANIFEST.json"]
    # An empty folder left behind by someone else does not block a publish.
    control.folders[bucket].add("backups/steps/8/")
    store.put_bytes("staging/8-ef/MANIFEST.json", b"{}")
    assert store.publish("staging/8-ef", "steps/8") is True
    assert store.list("steps/8/") == ["steps/8/MANIFEST.json"]


@pytest.mark.process  # the GCS emulator
def test_gcs_publish_on_flat_bucket(bucket: str, emulator: Emulator, tmp_path: Path) -> None:
    flat = FakeStorageControl(emulator, hns=set())  # the bucket exists, without HNS
    try:
        store = GcsBackend(f"gs://{bucket}", control_endpoint=flat.endpoint, **FAST)
        store.put_bytes("staging/1-x/MANIFEST.json", b"{}")
        assert store.can_publish() is False
        assert store.publish("staging/1-x", "steps/1") is False
        assert store.list("") == ["staging/1-x/MANIFEST.json"]
        assert [c[0] for c in flat.calls] == ["GetStorageLayout"]
    finally:
        flat.stop()


@pytest.mark.process  # the GCS emulator
def test_gcs_control_api_unreachable(bucket: str) -> None:
    store = GcsBackend(f"gs://{bucket}", control_endpoint=f"127.0.0.1:{free_port()}",
                       deadline=1.0, initial_backoff=0.05, max_backoff=0.2, timeout=1.0)
    with pytest.raises(BackupUnavailableError):
        store.can_publish()
