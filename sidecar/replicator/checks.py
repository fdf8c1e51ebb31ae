"""Requests and peers' answers, checked where they arrive, before anything is stored,
written or read: every step and epoch an integer in range, every rank a node's,
every path relative and inside (:mod:`mtc.validate`), and no count without a bound.

A bad request raises a :class:`~mtc.errors.FatalError` (``INVALID_ARGUMENT`` on the
wire) naming what is wrong; a peer's inventory that fails is not used at all.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mtc import validate
from mtc.errors import CorruptShardError, ProtocolError
from mtc.manifest import check_run
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.store.step_files import FileMeta

MAX_FILES = 100_000       # files of one copy: an Offer, a fetch of several, a backup part
MAX_OPEN_FILES = 200_000  # files of every open incoming transfer together
MAX_LOST_CHARS = 1 << 16  # a decision's account of the data gone
# Steps of one origin an inventory lists (copies, or damaged own steps): a host keeps
# a few of each (``--keep`` and those waiting for replication or a backup); tens of
# thousands made up would each cost the gatherer a proof check (issue 66).
MAX_STEPS_PER_ORIGIN = 256
_STAGING = re.compile(r"staging/(\d+)-[0-9a-f]{8}")


def offer(c: pb.StepCopy, *, rank: int, num_nodes: int) -> tuple[int, int, list[FileMeta]]:
    """An Offer's origin, step and files."""
    origin = validate.count(c.origin_rank, "origin rank", num_nodes - 1)
    if origin == rank:
        raise ProtocolError(f"origin rank {origin} is not a peer of rank {rank}")
    step = validate.step(c.step, host=origin)
    validate.count(c.saved_hosts, "saved hosts", num_nodes)  # as an inventory's
    saving(c, host=origin, num_nodes=num_nodes)
    if len(c.files) > MAX_FILES:
        raise ProtocolError(f"an offer of {len(c.files)} files (at most {MAX_FILES})",
                            step=step, host=origin)
    files = [FileMeta(validate.relpath(f.path), validate.file_size(f.size, path=f.path[:200]),
                      f.crc32c) for f in c.files]
    _distinct([f.path for f in files], "the offer", step=step, host=origin)
    return origin, step, files


def saving(c: pb.StepCopy, *, host: int, num_nodes: int) -> None:
    """A copy's saving ranks, when it states them: one distinct node's rank per
    saving host (``[1, 1]`` would have two saving hosts read as one rank's data)."""
    r = list(c.saving_ranks)
    if r and (len(r) != c.saved_hosts or len(set(r)) != len(r)
              or any(not 0 <= x < num_nodes for x in r)):
        raise ProtocolError(f"saving ranks {r[:16]} are not {c.saved_hosts} distinct ranks "
                            f"of the {num_nodes} nodes", step=c.step, host=host)


def _distinct(paths: list[str], what: str, *, step: int, host: int) -> None:
    """Each file once, and no name both a file and a folder: such a step cannot
    be written (its second file fails half-way through a transfer or a fetch)."""
    names = set(paths)
    if len(names) != len(paths):
        raise ProtocolError(f"duplicate paths in {what}", step=step, host=host)
    folder = next((d for d in _folders(names) if d in names), None)
    if folder is not None:
        raise ProtocolError(f"{what} names {folder[:200]!r} both as a file and as a folder",
                            step=step, host=host)


def _folders(paths: set[str]) -> set[str]:
    """Every folder the relative ``paths`` lie in ("a/b/c": "a" and "a/b")."""
    out: set[str] = set()
    for p in paths:
        i = p.find("/")
        while i != -1:
            out.add(p[:i])
            i = p.find("/", i + 1)
    return out


def pushed(offered: Sequence[FileMeta], idx: Sequence[int]) -> list[FileMeta]:
    """The offered files a push names by index into the offer's file list
    (``offered``), each once: the data channel's request, gRPC's ``x-mtc-files``.
    ValueError (``INVALID_ARGUMENT``) as the push's other bad input."""
    if not idx or len(idx) > MAX_FILES or any(not 0 <= i < len(offered) for i in idx) \
            or len(set(idx)) != len(idx):
        raise ValueError(f"a push names files outside the offer of {len(offered)}, or twice")
    return [offered[i] for i in idx]


def not_as_offered(meta: FileMeta, got: int, value: int, *, step: int, origin: int
                   ) -> CorruptShardError | None:
    """The error of a pushed file received as ``got`` bytes with CRC32C ``value``
    when its offer said otherwise (the caller removes the file), else None."""
    if got == meta.size and value == meta.crc32c:
        return None
    return CorruptShardError(f"received {got} bytes with crc32c {value:#010x}, offer said "
                             f"{meta.size} bytes {meta.crc32c:#010x}", step=step, host=origin,
                             path=meta.path)


def fetch(req: pb.FetchRequest, *, num_nodes: int) -> tuple[int, int, list[str]]:
    """A Fetch's origin, step and paths (one, or several distinct ones)."""
    origin = validate.count(req.origin_rank, "origin rank", num_nodes - 1)
    step = validate.step(req.step, host=origin)
    rels = [validate.relpath(req.path)]
    if req.more_paths:
        if len(req.more_paths) >= MAX_FILES or req.offset:
            raise ProtocolError("too many files, or an offset, in a fetch of several",
                                step=step, host=origin)
        rels += [validate.relpath(p) for p in req.more_paths]
        # Each file once: a request naming one file many times would have its bytes
        # sent many times over (a few bytes asked, gigabytes sent).
        if len(set(rels)) != len(rels):
            raise ProtocolError("a fetch names a file twice", step=step, host=origin)
    validate.file_size(req.offset)
    return origin, step, rels


def backup_part(req: pb.BackupPartRequest, *, num_nodes: int) -> tuple[int, int, str]:
    """A BackupPart's step, origin and prefix: the step's own folder (``steps/<step>``)
    or a staging folder of that step (``staging/<step>-<8 hex>``), nothing else, and
    each path once."""
    step = validate.step(req.step)
    origin = validate.count(req.origin_rank, "origin rank", num_nodes - 1)
    staged = _STAGING.fullmatch(req.prefix)
    if req.prefix != f"steps/{step}" and not (staged and int(staged.group(1)) == step):
        raise ProtocolError(f"backup prefix {req.prefix[:100]!r} is not step {step}'s",
                            step=step, host=origin)
    paths = [validate.relpath(p) for p in (*req.upload, *req.hash)]
    if len(paths) > MAX_FILES or len(set(paths)) != len(paths):
        raise ProtocolError("a backup part names a file twice, or too many", step=step,
                            host=origin)
    return step, origin, req.prefix


def restore_id(rid: str) -> str:
    return validate.ident(rid, "restore id")


def decision(d: pb.Decision, *, host: int) -> pb.Decision:
    """A decision the coordinator answered: its epoch and step in range, its run a run
    identity (it is kept, and reported in this node's inventories)."""
    validate.epoch(d.epoch)
    if d.step != -1:
        validate.step(d.step, what="decided step", host=host)
    _run(d.run, host)
    if len(d.lost) > MAX_LOST_CHARS:
        raise ProtocolError(f"a decision's lost data is {len(d.lost)} characters", host=host)
    return d


def inventory(inv: pb.Inventory, *, rank: int, num_nodes: int) -> pb.Inventory:
    """A peer's inventory, answered by ``rank``: refused whole (ProtocolError) when
    anything in it is out of range, so that nothing it says is stored or acted on
    (an epoch near 2^63 would be recorded, a path written to)."""
    if inv.rank != rank:
        raise ProtocolError(f"rank {rank} answered as rank {inv.rank}", host=rank)
    d = inv.last_decision
    if d.epoch:
        decision(d, host=rank)
        validate.ident(d.restore_id, "restore id")
    _steps([s for s in inv.backed_up_steps], rank)
    if inv.newest_backed_up_step != -1:
        validate.step(inv.newest_backed_up_step, what="backed-up step", host=rank)
    bounded(inv, rank)
    for c in inv.damaged:
        if c.origin_rank != rank:
            raise ProtocolError(f"rank {rank} listed rank {c.origin_rank}'s step {c.step} "
                                f"as its own damaged step", host=rank)
    for c in [*inv.copies, *inv.damaged]:
        validate.count(c.origin_rank, "origin rank", num_nodes - 1)
        validate.step(c.step, host=rank)
        validate.count(c.saved_hosts, "saved hosts", num_nodes)
        saving(c, host=rank, num_nodes=num_nodes)
        _run(c.run, rank)
        if len(c.files) > MAX_FILES:
            raise ProtocolError(f"a copy of {len(c.files)} files", step=c.step, host=rank)
        for f in c.files:
            validate.relpath(f.path)
            validate.file_size(f.size, path=f.path[:200])
            if len(f.sha256) not in (0, 32):
                raise ProtocolError(f"a SHA-256 of {len(f.sha256)} bytes", step=c.step,
                                    host=rank)
        _distinct([f.path for f in c.files], f"rank {c.origin_rank}'s step {c.step}",
                  step=c.step, host=rank)
    return inv


def bounded(inv: pb.Inventory, rank: int) -> None:
    """At most :data:`MAX_STEPS_PER_ORIGIN` entries of one origin, each (origin, step)
    once: counted before anything in the inventory is checked further (a proof
    costs far more than a count)."""
    for what, entries in (("copies", inv.copies), ("damaged steps", inv.damaged)):
        per: dict[int, int] = {}
        seen: set[tuple[int, int]] = set()
        for c in entries:
            n = per[c.origin_rank] = per.get(c.origin_rank, 0) + 1
            if n > MAX_STEPS_PER_ORIGIN:
                raise ProtocolError(f"more than {MAX_STEPS_PER_ORIGIN} {what} of rank "
                                    f"{c.origin_rank}'s data listed", host=rank)
            if (c.origin_rank, c.step) in seen:
                raise ProtocolError(f"rank {c.origin_rank}'s step {c.step} listed twice "
                                    f"in {what}", step=c.step, host=rank)
            seen.add((c.origin_rank, c.step))


def kept(reply: pb.CompleteReply, *, host: int) -> frozenset[int]:
    """The coordinator's steps that garbage collection leaves, each a valid step."""
    if len(reply.kept) > 2:
        raise ProtocolError(f"{len(reply.kept)} steps kept, at most 2", host=host)
    return frozenset(validate.step(s, what="step kept", host=host) for s in reply.kept)


def _run(run: str, host: int) -> None:
    try:
        check_run(run)
    except ValueError as e:
        raise ProtocolError(str(e), host=host) from None


def _steps(steps: Sequence[int], rank: int) -> None:
    for s in steps:
        validate.step(s, what="backed-up step", host=rank)
