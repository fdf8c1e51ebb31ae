"""Fail an image build whose Python or pinned packages differ from what the images must share.

Run by both Dockerfiles after installing: the controller pickles functions that
the colocated-Python sidecar runs, so the trainer and sidecar images need the
same Python minor version and the same jax and jaxlib (Pathways requires it).

    python check_image.py --python 3.11 --requirements requirements.txt [--packages jax jaxlib]
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


def problems(python: str, requirements: Path, packages: Sequence[str]) -> list[str]:
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
            found.append(f"{name} {got} installed, {want} pinned")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", required=True, help="expected MAJOR.MINOR")
    p.add_argument("--requirements", type=Path, required=True)
    p.add_argument("--packages", nargs="+", default=["jax", "jaxlib"])
    args = p.parse_args(argv)
    found = problems(args.python, args.requirements, args.packages)
    for line in found:
        print(f"check_image: {line}", file=sys.stderr)
    if not found:
        print(f"check_image: Python {args.python}, "
              + ", ".join(f"{n} {md.version(n)}" for n in args.packages))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
