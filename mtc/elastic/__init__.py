"""Elastic training with mtc: what the Pathways guide's elastic loop needs.

- :class:`Snapshotter`: the newest state in host memory on every device, with
  the interface of Orbax's ``ocp.v1.training.pathways.Snapshotter``; given an
  ``mtc.CheckpointManager`` it falls back through mtc's tiers when no surviving
  device holds some shard.
  Asked every step, it snapshots as often as the loop's budget allows (5% of
  its time by default) and says how old the newest one is (:class:`Age`).
- :class:`InGraphStep`: a jitted train step that also emits the snapshot copy.
- :class:`CompileAhead`: the step compiled in the background for every mesh
  replica resize can reach, with JAX's persistent compilation cache.
- :func:`patched`: pathwaysutils' slice grouping (devices without
  ``slice_index``) and a cached slice health check, installed for a ``with``
  block and put back after.
"""

from mtc.elastic.compile_ahead import CACHED, COMPILED, READY, CompileAhead, ahead_meshes
from mtc.elastic.in_graph import InGraphStep
from mtc.elastic.pathways_patch import CachedSliceHealthChecker, group_consecutive, patched
from mtc.elastic.placement import SnapshotUnavailableError
from mtc.elastic.snapshot import Snapshotter
from mtc.elastic.taken import Age, Latest

__all__ = ["CACHED", "COMPILED", "READY", "Age", "CachedSliceHealthChecker", "CompileAhead",
           "InGraphStep", "Latest", "SnapshotUnavailableError", "Snapshotter", "ahead_meshes",
           "group_consecutive", "patched"]
