"""The demo's name for the cached slice health check of :mod:`mtc.elastic.pathways_patch`."""

from mtc.elastic.pathways_patch import CachedSliceHealthChecker, install

__all__ = ["CachedSliceHealthChecker", "install"]
