"""The elastic trainer's builds ahead of time: for every mesh replica resize can
reach from where training runs (and the way back up), the step's program and the
RNG wrapper, compiled and warmed up on the background compiler
(:class:`mtc.elastic.compile_ahead.AheadCompiler`) and logged as they finish."""

from __future__ import annotations

from mtc.trainer import aot
from mtc.trainer.jsonlog import JsonLog
from mtc.trainer.meshes import SliceMeshes, Slices


def queue_ahead(ahead: aot.AheadCompiler, meshes: SliceMeshes, slices: Slices, *,
                total: int, depth: int, program: str, nice: int, log: JsonLog) -> None:
    """Queue the programs of every mesh replica resize can reach from ``slices``
    (``depth`` slices fewer at most, of ``total``; and back up) on ``ahead``; drop
    queued ones no longer wanted."""
    targets = aot.ahead_meshes(slices, total, depth)
    names = aot.names(targets)
    ahead.retarget(names)
    for m, name in zip(targets, names, strict=True):
        def job(m: Slices = m) -> None:
            t = meshes.trainer(m)
            for p in (program, "wrap_rng"):
                if not t.ready(p):
                    built = t.prepare(p, ahead=True, nice=nice)
                    ahead.wait_released()  # no warm-up while a recovery runs
                    warm = t.warm_up(p) if p != "wrap_rng" else 0.0
                    log.write(event="compiled_ahead", slices=list(m), program=p,
                              source=built.source, seconds=built.seconds, warm_up_s=warm)
        ahead.submit(name, job)
