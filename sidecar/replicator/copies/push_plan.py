"""Which files of a step's push travel together, pure: over the data channel, a few
streams of about equal bytes (:func:`push_streams`); over gRPC, large files one per
call and small ones batched (:func:`push_batches`)."""

from __future__ import annotations

from mtc.sidecar.replicator.store.step_files import FileMeta

BATCH_BYTES = 4 << 20  # small files travel together, up to this many bytes a call
BATCH_FILES = 512  # and this many files (their indices ride in the call's metadata)
PUSH_STREAMS = 4  # data-channel connections a step's push uses at once (the push pool's)


def push_streams(files: list[tuple[int, FileMeta]], n: int) -> list[list[tuple[int, FileMeta]]]:
    """``files`` split into at most ``n`` groups of about equal bytes (largest first,
    each to the lightest group), each group in offer order. Pure."""
    groups: list[list[tuple[int, FileMeta]]] = [[] for _ in range(max(1, min(n, len(files))))]
    loads = [0] * len(groups)
    for i, f in sorted(files, key=lambda x: (-x[1].size, x[0])):
        k = loads.index(min(loads))
        groups[k].append((i, f))
        loads[k] += f.size
    return [sorted(g, key=lambda x: x[0]) for g in groups if g]


def push_batches(files: list[tuple[int, FileMeta]]) -> list[list[tuple[int, FileMeta]]]:
    """Large files one per call (streamed, in parallel); small ones together, up to
    BATCH_BYTES or BATCH_FILES a call (their index in the offer travels as metadata)."""
    out: list[list[tuple[int, FileMeta]]] = []
    batch: list[tuple[int, FileMeta]] = []
    held = 0
    for i, f in files:
        if f.size >= BATCH_BYTES // 4:
            out.append([(i, f)])
            continue
        if batch and (held + f.size > BATCH_BYTES or len(batch) == BATCH_FILES):
            out.append(batch)
            batch, held = [], 0
        batch.append((i, f))
        held += f.size
    if batch:
        out.append(batch)
    return out
