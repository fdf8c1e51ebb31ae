"""Fail an image build whose Python or pinned packages differ from what the images must share.

Run by both Dockerfiles after installing: the controller pickles functions that
the colocated-Python sidecar runs, so the trainer and sidecar images need the
same Python minor version and the same jax and jaxlib (Pathways requires it).
``requirements.txt`` is the trainer image's lock: in the colocated-Python image,
whose jax and jaxlib come from Google's base, this is where a base that does not
match the trainer is caught.

    python check_image.py --python 3.12 --requirements requirements.txt \
        [--packages jax jaxlib] [--colocated-server]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from collections.abc import Sequence
from pathlib import Path


def pins(requirements: Path) -> dict[str, str]:
    """``name==version`` lines of a requirements file, by normalized name."""
    out = {}
    for line in requirements.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def colocated_server_problem() -> str | None:
    """Google's sidecar bases ship a jaxlib built with the colocated-Python CPU client;
    a jaxlib from PyPI installed over it has none, and the server cannot start."""
    try:
        from jax._src.lib import _jax  # type: ignore[attr-defined]
    except ImportError as e:
        return f"jaxlib does not import: {e}"
    if not hasattr(_jax, "colocated_python_cpu_client"):
        return ("jaxlib has no colocated_python_cpu_client: the base's jaxlib was replaced "
                "(install with the base's constraints)")
    return None


def problems(python: str, requirements: Path, packages: Sequence[str],
             colocated_server: bool = False) -> list[str]:
    found = []
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    if have != python:
        found.append(f"Python {have}, expected {python}")
    pinned = pins(requirements)
    for name in packages:
        want = pinned.get(re.sub(r"[-_.]+", "-", name).lower())
        if want is None:
            found.append(f"{name} is not pinned in {requirements}")
            continue
        try:
            got = md.version(name)
        except md.PackageNotFoundError:
            found.append(f"{name} is not installed (pinned {want})")
            continue
        if got != want:
            found.append(f"{name} {got} installed, {want} pinned (the trainer image's)")
    if colocated_server:
        problem = colocated_server_problem()
        if problem:
            found.append(problem)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", required=True, help="expected MAJOR.MINOR")
    p.add_argument("--requirements", type=Path, required=True)
    p.add_argument("--packages", nargs="+", default=["jax", "jaxlib"])
    p.add_argument("--colocated-server", action="store_true",
                   help="also check that jaxlib has the colocated-Python server's client")
    args = p.parse_args(argv)
    found = problems(args.python, args.requirements, args.packages, args.colocated_server)
    for line in found:
        print(f"check_image: {line}", file=sys.stderr)
    if not found:
        print(f"check_image: Python {args.python}, "
              + ", ".join(f"{n} {md.version(n)}" for n in args.packages))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
