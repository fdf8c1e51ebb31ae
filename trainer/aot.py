"""The demo's name for :mod:`mtc.elastic.compile_ahead` (the library's module)."""

from mtc.elastic.compile_ahead import (
    CACHED,
    COMPILED,
    READY,
    AheadCompiler,
    Built,
    Slices,
    Use,
    ahead_meshes,
    build,
    enable_cache,
    lowered_priority,
    names,
)

__all__ = ["CACHED", "COMPILED", "READY", "AheadCompiler", "Built", "Slices", "Use",
           "ahead_meshes", "build", "enable_cache", "lowered_priority", "names"]
