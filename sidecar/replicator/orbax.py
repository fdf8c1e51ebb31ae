"""The file protocol of GKE's replicator, as Orbax's multi-tier client speaks it.

Orbax's ``initialize_multi_tier_checkpointing`` writes ``replicator.yaml`` into
the RAM disk at every job start, waits for the replicator to delete it, then
waits for a restore marker ``<job>-s<step>-n<rank>-w0.restore``: a symlink to
the folder holding the step to restore, which it renames to ``<local>/<step>``,
or an empty file with step 0 for "nothing to restore". The client trusts the
marker blindly, so this module guarantees what it does not check: every node
restores the same (agreed) step, and no other step folder is left in the RAM
disk for the client to list as restorable.

``replicator.errors`` (logged by the client) and ``replicator.failed`` (fatal
for the client) report problems; the client reads them only while it waits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import yaml

from mtc.errors import ConfigError
from mtc.layout import TMP_MARK
from mtc.sidecar.storage.deleter import remove_step
from mtc.sidecar.storage.names import tmp_name
from mtc.sidecar.storage.publish import publish, replace, write_atomic

log = logging.getLogger(__name__)

YAML_NAME = "replicator.yaml"
ERRORS_NAME = "replicator.errors"
FAILED_NAME = "replicator.failed"
BACKUP_REQUESTED = "_BACKUP_REQUESTED"


@dataclasses.dataclass(frozen=True)
class ClientRequest:
    """What ``replicator.yaml`` says."""

    job_name: str
    rank: int
    nodes: int
    peer_ranks: tuple[int, ...]
    data_parallelism: int
    backup_interval_minutes: int | None
    backup_interval_steps: int | None
    restore_id: str = ""  # given when taken; the same after a replicator restart

    @property
    def num_slices(self) -> int:
        return len(self.peer_ranks) + 1

    @property
    def nodes_per_slice(self) -> int:
        return self.nodes // self.num_slices


def parse_request(text: str) -> ClientRequest:
    try:
        d: dict[str, Any] = yaml.safe_load(text) or {}
        if not isinstance(d, dict):
            raise ValueError(f"not a mapping: {type(d).__name__}")
        if d.get("framework", "orbax") != "orbax":
            raise ConfigError(f"framework {d.get('framework')!r} is not supported")
        req = ClientRequest(
            job_name=str(d["job-name"]), rank=int(d["node-rank"]), nodes=int(d["nodes"]),
            peer_ranks=tuple(int(x) for x in d.get("peer-ranks") or ()),
            data_parallelism=int(d.get("assume-data-parallelism", 1)),
            backup_interval_minutes=(int(d["backup-interval-minutes"])
                                     if "backup-interval-minutes" in d else None),
            backup_interval_steps=(int(d["backup-interval-steps"])
                                   if "backup-interval-steps" in d else None))
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError, yaml.YAMLError) as e:
        raise ConfigError(f"malformed {YAML_NAME}: {e!r}"[:500]) from e
    if not req.job_name or "/" in req.job_name or not req.job_name.isprintable():
        # It names the restore marker: a file name the client's pattern must match.
        raise ConfigError(f"{YAML_NAME}: job-name {req.job_name!r} cannot name a file")
    for line in text.splitlines():
        if line.startswith(RID_COMMENT):
            req = dataclasses.replace(req, restore_id=line[len(RID_COMMENT):].strip())
    if not 0 <= req.rank < req.nodes or req.nodes % req.num_slices:
        raise ConfigError(f"{YAML_NAME}: rank {req.rank} of {req.nodes} nodes with "
                          f"{req.num_slices} slices is inconsistent")
    return req


PENDING_NAME = ".mtc-client-request.yaml"  # a taken request not answered yet
RID_COMMENT = "# mtc-restore-id:"


def take_request(root: Path) -> ClientRequest | None:
    """Consume ``replicator.yaml`` if present (the client waits for its deletion).

    A request is kept as :data:`PENDING_NAME` until :func:`done_request`: a
    replicator restarted before answering serves it again (:func:`pending_request`)
    instead of leaving the client waiting for a marker nobody writes. A request
    that cannot be served gets ``replicator.failed`` *before* the yaml disappears:
    the client checks for it right after.
    """
    path = root / YAML_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        req = parse_request(text)
    except ConfigError as e:
        report(root, str(e), fatal=True)
        path.unlink(missing_ok=True)
        raise
    rid = uuid.uuid4().hex
    write_atomic(root / PENDING_NAME, f"{text.rstrip()}\n{RID_COMMENT} {rid}\n")
    path.unlink(missing_ok=True)  # consumed: the client goes on to wait for the marker
    return dataclasses.replace(req, restore_id=rid)


def pending_request(root: Path) -> ClientRequest | None:
    """A request taken by an earlier run of this replicator and not answered."""
    try:
        text = (root / PENDING_NAME).read_text()
    except FileNotFoundError:
        return None
    try:
        return parse_request(text)
    except ConfigError:
        (root / PENDING_NAME).unlink(missing_ok=True)
        raise


def done_request(root: Path) -> None:
    (root / PENDING_NAME).unlink(missing_ok=True)


def refuse_request(root: Path, why: str) -> None:
    """Answer a ``replicator.yaml`` this replicator will not serve: ``replicator.failed``
    first (the client reads it as soon as the yaml is gone), then consume the yaml."""
    report(root, why, fatal=True)
    (root / YAML_NAME).unlink(missing_ok=True)


def report(root: Path, message: str, *, fatal: bool = False) -> None:
    """Append to ``replicator.errors``, or write ``replicator.failed`` when fatal."""
    path = root / (FAILED_NAME if fatal else ERRORS_NAME)
    with open(path, "a") as f:
        f.write(message.rstrip("\n") + "\n")


def marker_name(job: str, step: int, rank: int) -> str:
    return f"{job}-s{step}-n{rank}-w0.restore"


def clear_markers(root: Path) -> None:
    """Remove the restore markers, and any a crash left half made (hidden, named
    by :func:`~mtc.sidecar.storage.names.tmp_name`: never ``*.restore``)."""
    for p in [*root.glob("*.restore"), *root.glob(f".*.restore{TMP_MARK}*")]:
        p.unlink(missing_ok=True)


def write_marker(root: Path, job: str, step: int, rank: int, target: Path | None) -> Path:
    """The restore marker: a symlink to ``target``, or an empty step-0 file for none."""
    clear_markers(root)
    final = root / marker_name(job, 0 if target is None else step, rank)
    tmp = tmp_name(final)
    if target is None:
        tmp.touch()
    else:
        # Relative, so it resolves inside the RAM disk wherever it is mounted.
        os.symlink(os.path.relpath(target, root), tmp)
    try:
        replace(tmp, final)  # the client polls: it must never see a half-made marker
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def hide_step_folders(root: Path, keep_in: Path) -> list[int]:
    """Move every step folder out of the client's sight into ``keep_in``.

    Returns the steps moved; earlier restored steps (symlinks) are unlinked.
    """
    moved = []
    keep_in.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(root):
        p = root / name
        if not name.isdigit():
            continue
        if p.is_symlink():
            p.unlink()
            continue
        if p.is_dir():
            dst = keep_in / name
            if dst.exists():
                remove_step(root, int(name))
            else:
                publish(p, dst)
                moved.append(int(name))
    return moved


def backup_requested(step_dir: Path) -> bool:
    return (step_dir / BACKUP_REQUESTED).exists()
