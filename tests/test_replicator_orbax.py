"""The Orbax client's file protocol on the replicator's side (sidecar/replicator/orbax.py):
restore markers."""

from __future__ import annotations

import os
from pathlib import Path

from mtc.sidecar.replicator import orbax
from mtc.sidecar.storage.names import tmp_name


def test_a_marker_appears_whole_and_replaces_the_last(tmp_path: Path) -> None:
    (tmp_path / "5").mkdir()
    first = orbax.write_marker(tmp_path, "job", 5, 1, tmp_path / "5")
    assert os.readlink(first) == "5"
    second = orbax.write_marker(tmp_path, "job", 0, 1, None)
    assert sorted(os.listdir(tmp_path)) == sorted(["5", second.name])  # no leftovers
    assert second.name == "job-s0-n1-w0.restore" and second.is_file()


def test_clearing_removes_markers_a_crash_left_half_made(tmp_path: Path) -> None:
    marker = tmp_path / orbax.marker_name("job", 5, 1)
    half = tmp_name(marker)
    os.symlink("5", half)  # the link made, the rename never done
    (tmp_path / "keep.txt").write_text("")
    assert not half.name.endswith(".restore")  # the client never takes it for one
    orbax.clear_markers(tmp_path)
    assert os.listdir(tmp_path) == ["keep.txt"]
