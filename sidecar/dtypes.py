"""numpy dtypes from the names that cross the seam, JAX's extra ones included.

JAX's dtypes that numpy lacks (bfloat16, float8_*, int4, ...) come from
``ml_dtypes``, which registers them with numpy when imported. Importing it costs
about 0.8 s of CPU, most of a sidecar's start-up, while most steps hold float32
and int32 only: it is imported the first time a name numpy does not know comes.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The dtype called ``name`` (``"float32"``, ``"bfloat16"``, ...); TypeError if none is."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # noqa: F401 - registers JAX's dtypes with numpy

        return np.dtype(name)
