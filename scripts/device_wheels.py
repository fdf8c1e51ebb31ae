"""The wheels that run mtc's device benchmarks on an accelerator host with no index.

Run with the Python of a virtual environment that has mtc installed at the
versions to ship (the oldest lane's, ``.venv-oldest``, for a host with Python
3.11)::

    .venv-oldest/bin/python scripts/device_wheels.py .tpu-wheels

It writes ``CLOSURE.txt`` into the folder (every distribution mtc needs at run
time, followed through their own requirements, at the versions installed here,
less the ones the host keeps: its JAX and what JAX brings), downloads their
wheels for this Python, and builds mtc's own. docs/hosts.md says how to install
them there.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
# What an accelerator host's JAX comes with (never installed over it).
HOST_KEEPS = frozenset({"jax", "jaxlib", "numpy", "scipy", "ml-dtypes", "opt-einsum"})


def closure(root: str, requires: Callable[[str], Iterable[str]],
            keep: Iterable[str] = HOST_KEEPS, extras: Iterable[str] = ()) -> list[str]:
    """Every distribution ``root`` needs at run time (``requires`` gives one's
    requirement strings; markers as this Python evaluates them; no extras but
    ``root``'s own ``extras``), less ``root``, ``keep`` and what only they need,
    sorted."""
    kept = {canonicalize_name(k) for k in keep}
    root = canonicalize_name(root)
    seen: set[str] = set()
    todo = [root]
    while todo:
        name = todo.pop()
        if name in seen or name in kept:
            continue
        seen.add(name)
        wanted = ("", *extras) if name == root else ("",)
        for line in requires(name):
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted):
                todo.append(canonicalize_name(req.name))
    return sorted(seen - {root})


def _installed_requires(name: str) -> list[str]:
    try:
        return md.distribution(name).requires or []
    except md.PackageNotFoundError:  # an optional one not installed: not shipped
        return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("folder", type=Path, help="where the wheels and CLOSURE.txt go")
    p.add_argument("--extra", action="append", default=[], metavar="NAME",
                   help="also mtc's extra NAME (trainer: what bench/goodput.py and "
                        "bench/recovery.py run, the elastic trainer's optax)")
    args = p.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    pins = []
    for name in closure("mtc", _installed_requires, extras=args.extra):
        try:
            pins.append(f"{name}=={md.version(name)}")
        except md.PackageNotFoundError:
            continue
    listing = args.folder / "CLOSURE.txt"
    listing.write_text("".join(f"{pin}\n" for pin in pins))
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "-d",
                    str(args.folder), "-r", str(listing)], check=True)
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(REPO), "-w",
                    str(args.folder)], check=True)
    print(f"{len(pins)} wheels and mtc's in {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
