"""The controller's package (all of mtc/) imports nothing of the replicator's.

The controller runs on another machine than the replicators; what both sides use
lives in ``mtc/``: the credentials (``mtc/credentials.py``), the certificates' names
as ranks (``mtc/rank_names.py``), errors as gRPC statuses and ``PeerError``
(``mtc/grpc_errors.py``), the placement rule (``mtc/placement.py``). The host seam
(``mtc/dispatch/``) is held to it too: it runs the host side in the controller's
process (``LocalDispatch``) through the host side's own modules (``mtc.sidecar.save``,
``mtc.sidecar.restore``), never the replicator's directly. The uses left are listed with why;
a new one fails, and so does a listed one no longer there. Imports only (a module
named in a string is not read).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import mtc

ROOT = Path(mtc.__file__).parent
REPLICATOR = "mtc.sidecar.replicator"
_CLIENT = "mtc.sidecar.replicator.wire.client"
# (file under mtc/, module it imports): why it still does.
ALLOWED = {
    # PeerClient opens the replicator's data channel to a peer (wire/peer_data.py and
    # what it uses) as it opens its gRPC channel: the controller's calls use the gRPC
    # part only, and the two come apart only with the client's data path.
    ("replicas.py", _CLIENT): "PeerClient",
    ("replicator_watch.py", _CLIENT): "PeerClient",
}


def imports_of(source: str) -> list[list[str]]:
    """Per import statement anywhere in ``source`` (lazy imports and ``TYPE_CHECKING``
    ones too), the names it may import: modules, and ``module.name`` for each name
    taken from a module (which may be a module itself)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.append([a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append([node.module] + [f"{node.module}.{a.name}" for a in node.names])
    return out


def replicator_imports(source: str) -> set[str]:
    """The replicator's modules ``source`` imports, anywhere in it."""
    found: set[str] = set()
    for names in imports_of(source):
        ours = [n for n in names if n == REPLICATOR or n.startswith(REPLICATOR + ".")]
        if ours:  # the module imported from, not the name taken from it
            found.add(min(ours, key=len))
    return found


@pytest.mark.parametrize(("source", "expected"), [
    ("from mtc.credentials import Credentials", set()),
    ("import mtc.sidecar.replicator.node", {"mtc.sidecar.replicator.node"}),
    ("from mtc.sidecar.replicator.wire.client import PeerClient", {_CLIENT}),
    ("from mtc.sidecar.replicator.wire import client", {"mtc.sidecar.replicator.wire"}),
    ("from mtc.sidecar import replicator", {"mtc.sidecar.replicator"}),
    ("from mtc.sidecar.restore.load import ShardLoader", set()),
    ("def f():\n    from mtc.sidecar.replicator.config import targets\n",
     {"mtc.sidecar.replicator.config"}),
    ("if TYPE_CHECKING:\n    import mtc.sidecar.replicator.wire.security as s\n",
     {"mtc.sidecar.replicator.wire.security"}),
])
def test_replicator_imports_reads_every_form(source: str, expected: set[str]) -> None:
    assert replicator_imports(source) == expected


def test_controller_imports_nothing_of_the_replicator() -> None:
    seen: set[tuple[str, str]] = set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        for module in replicator_imports(path.read_text()):
            seen.add((rel.as_posix(), module))
    assert seen - ALLOWED.keys() == set(), "the controller imports the replicator's modules"
    assert ALLOWED.keys() - seen == set(), "listed uses no longer there: remove them"


def test_mtc_testing_imports_nothing_of_the_demo_package() -> None:
    """mtc.testing (the local cluster, its hosts, the waits) is a user's test harness:
    it depends on mtc, never on the demo trainers (``mtc.trainer``), whose extras a
    user's tests need not install."""
    found = set()
    for path in sorted((ROOT / "testing").rglob("*.py")):
        for names in imports_of(path.read_text()):
            found |= {(path.name, n) for n in names
                      if n == "mtc.trainer" or n.startswith("mtc.trainer.")}
    assert found == set(), found


# Where each package's files are in the checkout (pyproject.toml's package-dir): read,
# never imported, so the walk below costs no import of JAX or the replicator.
PACKAGE_DIRS = {name: Path(spec.submodule_search_locations[0])
                for name in ("mtc", "mtc.sidecar", "mtc.trainer")
                if (spec := importlib.util.find_spec(name)) is not None
                and spec.submodule_search_locations}


def _module_file(name: str) -> Path | None:
    """The source file of module ``name`` (None: not a module, e.g. a class)."""
    package = max((p for p in PACKAGE_DIRS if name == p or name.startswith(p + ".")),
                  key=len, default=None)
    if package is None:
        return None
    folder = PACKAGE_DIRS[package].joinpath(*name[len(package):].split(".")[1:])
    for path in (folder / "__init__.py", folder.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def test_nothing_mtc_testing_reaches_imports_the_demo_package() -> None:
    """Nor through mtc's own modules: every mtc module mtc.testing imports, and every
    one those import (lazily too), transitively, leaves ``mtc.trainer`` out. A chain
    that reaches it is named, from the demo module back to mtc.testing."""
    came_from: dict[str, str | None] = {}
    todo: list[tuple[str, str | None]] = [
        ("mtc.testing" if p.stem == "__init__" else f"mtc.testing.{p.stem}", None)
        for p in sorted((ROOT / "testing").glob("*.py"))]
    while todo:
        name, via = todo.pop()
        if name in came_from:
            continue
        came_from[name] = via
        path = _module_file(name)
        if path is None:
            continue
        todo += [(n, name) for names in imports_of(path.read_text()) for n in names
                 if (n == "mtc" or n.startswith("mtc.")) and n not in came_from]
    chains = []
    for name in came_from:
        if name == "mtc.trainer" or name.startswith("mtc.trainer."):
            chain = [name]
            while (via := came_from[chain[-1]]) is not None:
                chain.append(via)
            chains.append(" <- ".join(chain))
    assert chains == [], chains
    assert len(came_from) > 50  # the walk did follow mtc's imports
