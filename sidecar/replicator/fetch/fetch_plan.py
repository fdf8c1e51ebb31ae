"""Where a restore's files come from, pure: per file the copies that hold it
(:func:`heal_sources`), the order they are tried (:func:`fetch_order`), which
files travel together in one stream (:func:`fetch_batches`), and, before any
restore is asked for, the sizes of the files a host without data of its own will
likely fetch (:func:`likely_restore`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.store.step_files import FileMeta


def fetch_batches(first: Sequence[tuple[int, int] | None], rank: int, streams: int
                  ) -> list[tuple[tuple[int, int], list[int]]]:
    """Which files to fetch in one stream, and from where: per file (by index) its
    first source ``(holder, origin)``; the files whose first source is another
    host, grouped by it, each group split into up to ``streams`` streams of
    consecutive files (taken in turn by the fetch pool). Pure."""
    groups: dict[tuple[int, int], list[int]] = {}
    for k, src in enumerate(first):
        if src is not None and src[0] != rank:
            groups.setdefault(src, []).append(k)
    out: list[tuple[tuple[int, int], list[int]]] = []
    for src, ks in groups.items():
        n = max(1, min(streams, len(ks)))
        size = -(-len(ks) // n)
        out += [(src, ks[j:j + size]) for j in range(0, len(ks), size)]
    return out


def likely_restore(rank: int, equivalents: Sequence[int],
                   held: Mapping[tuple[int, int], list[tuple[int, pb.StepCopy]]]
                   ) -> tuple[int, list[int]] | None:
    """(step, file sizes) of the copy a host of ``rank`` holding no step of its own
    (a replaced or wiped host) will most likely fetch when a restore comes: the
    newest step other hosts hold of its data (of the first of ``equivalents``
    that has one); None when no other host holds any. ``held``: the copies by
    (origin, step), as :func:`node_agreement.holders_of` finds them. A guess for
    setting RAM disk aside, never a decision: the restore's agreement decides the
    step. Pure."""
    for origin in equivalents:
        copies = [c for (o, _), holders in held.items() if o == origin
                  for h, c in holders if h != rank and c.files]
        if copies:
            newest = max(copies, key=lambda c: c.step)
            return newest.step, [f.size for f in newest.files]
    return None


def heal_sources(rank: int, step: int, origin: int, files: list[FileMeta],
                 invs: dict[int, pb.Inventory], run: str = ""
                 ) -> dict[str, tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    """Per wanted file (of ``origin``'s copy of ``step``, which ``rank`` restores),
    where to fetch it: ``(holder, origin)`` pairs, in two groups, of copies
    holding a file with the same path, size and CRC32C. First the copies of
    ``origin``'s data, except this host's own data (the copy being healed); then
    "twins": copies of other ranks' data of the same step (the same shard of a
    data-parallel leaf saved by another replica, or an Orbax peer's), tried only
    when every copy of ``origin``'s has failed. Only copies ``run`` wrote (any,
    when ""): the same path under the same step number in another run's copy is
    another checkpoint's file. Pure."""
    wanted = {f.path: (f.size, f.crc32c) for f in files}
    own: dict[str, list[tuple[int, int]]] = {}
    twins: dict[str, list[tuple[int, int]]] = {}
    for holder, inv in sorted(invs.items()):
        for c in inv.copies:
            if c.step != step or (holder == rank and c.origin_rank == rank) or \
                    (run and c.run != run):
                continue
            group = own if c.origin_rank == origin else twins
            for f in c.files:
                if wanted.get(f.path) == (f.size, f.crc32c):
                    group.setdefault(f.path, []).append((holder, c.origin_rank))
    return {p: (own.get(p, []), twins.get(p, [])) for p in wanted}


def fetch_order(rank: int, own: list[tuple[int, int]], twins: list[tuple[int, int]],
                i: int) -> list[tuple[int, int]]:
    """The order one file's sources are tried: copies on this host first (no
    network), then the other holders of this rank's data rotated by ``i`` (so
    the files of a restore spread over them), then twins, local ones first."""
    local = [s for s in own if s[0] == rank]
    remote = [s for s in own if s[0] != rank]
    twins = sorted(twins, key=lambda s: s[0] != rank)
    return local + _rotate(remote, i) + twins


def _rotate(sources: list[tuple[int, int]], i: int) -> list[tuple[int, int]]:
    if not sources:
        return []
    k = i % len(sources)
    return sources[k:] + sources[:k]
