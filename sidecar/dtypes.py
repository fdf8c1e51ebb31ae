"""numpy dtypes from the names that cross the seam, JAX's extra ones included.

JAX's dtypes that numpy lacks (bfloat16, float8_*, int4, ...) come from
``ml_dtypes``, which registers them with numpy when imported. Importing it is
most of a sidecar's start-up CPU, while most steps hold float32
and int32 only: it is imported the first time a name numpy does not know comes.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The dtype called ``name`` (``"float32"``, ``"bfloat16"``, ...); TypeError if none
    is, or if it is not plain numbers: bytes viewed as Python objects would be
    pointers, and a request naming ``object`` must never get them."""
    if not isinstance(name, str):
        raise TypeError(f"a dtype is named by a string, got {type(name).__name__}")
    try:
        dt = np.dtype(name)
    except TypeError:
        import ml_dtypes  # noqa: F401 - registers JAX's dtypes with numpy

        dt = np.dtype(name)
    if dt.hasobject or dt.kind not in _NUMERIC_KINDS or dt.itemsize == 0:
        raise TypeError(f"dtype {name!r} is not an array element type mtc saves")
    return dt


# bool, integers, floats, complex; "V": ml_dtypes' (bfloat16, float8_*, int4, ...)
_NUMERIC_KINDS = frozenset("biufcV")
