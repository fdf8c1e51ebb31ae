"""The benchmarks' progress lines: on stderr, flushed at once, each naming its
benchmark and the time of day. Imported without side effects (unlike ``_common``)."""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable


def log(msg: str, name: str = "bench") -> None:
    print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def logger(name: str) -> Callable[[str], None]:
    """:func:`log` with ``name`` on every line."""
    return functools.partial(log, name=name)
