"""mypy over the modules as they are installed: ``make typecheck``.

pyproject.toml's ``package-dir`` installs the design card's folders ``sidecar/``
and ``trainer/`` as ``mtc.sidecar`` and ``mtc.trainer``. mypy names a file by the
folders above it (``sidecar/save/agent.py`` would be ``sidecar.save.agent``) and cannot
follow an editable install's import hook, so this script hands it every file
with the module name the installed package gives it: mypy, ruff and Python see
the same modules under the same names.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from mypy import build
from mypy.main import process_options
from mypy.modulefinder import BuildSource

REPO = Path(__file__).resolve().parents[1]
EXTRA = {"bench": "bench", "scripts": "scripts"}  # checked, not installed


def sources() -> list[BuildSource]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders: dict[str, str] = {**config["tool"]["setuptools"]["package-dir"], **EXTRA}
    # Nested mappings (mtc.sidecar inside mtc) are walked on their own: skip them
    # in the parent's walk.
    mapped = {(REPO / f).resolve() for f in folders.values()}
    found = []
    for package, folder in folders.items():
        top = REPO / folder
        for path in sorted([*top.rglob("*.py"), *top.rglob("*.pyi")]):
            if any(p in mapped and p != top.resolve() for p in path.resolve().parents):
                continue
            if path.suffix == ".py" and path.with_suffix(".pyi").exists():
                continue  # the generated stub describes the generated module
            parts = list(path.relative_to(top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.append(BuildSource(str(path.relative_to(REPO)), ".".join([package, *parts])))
    return found


def main() -> int:
    files = sources()
    _, options = process_options(["--config-file", str(REPO / "pyproject.toml"), "mtc"])
    result = build.build(files, options)
    for line in result.errors:
        print(line)
    print(f"mypy: {len(result.errors)} problems in {len(files)} files", file=sys.stderr)
    return 1 if result.errors else 0


if __name__ == "__main__":
    sys.exit(main())
