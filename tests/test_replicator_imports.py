"""The replicator's folders import each other one way only (issue 69).

``sidecar/replicator/{store,copies,agree,fetch,wire}/``: no two of them import each
other, directly or around a loop, and no two of the replicator's modules do
either (a loop among files, like the one the split of the client made, is a
circle too). The replicator's logic (store, copies, agree, fetch) reaches its
peers through the transport interface (``transport.py``), never ``wire/``
directly: ``wire/`` implements it. Imports of every form count: lazy ones inside
functions and ``TYPE_CHECKING`` ones too (a type is a dependency).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import mtc.sidecar.replicator as replicator

ROOT = Path(replicator.__file__).parent
PKG = "mtc.sidecar.replicator"
FOLDERS = ("store", "copies", "agree", "fetch", "wire")
LOGIC = ("store", "copies", "agree", "fetch")  # what may not import wire/


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """The replicator's modules ``source`` (of ``module``) imports, anywhere in it:
    ``from pkg import name`` counts as ``pkg.name`` when that is a module, else
    ``pkg``; relative imports resolved against ``module``."""
    found: set[str] = set()
    here = module if is_package else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for a in node.names:
                found.add(f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base)
    return {m for m in found if m == PKG or m.startswith(PKG + ".")}


def _is_module(name: str) -> bool:
    if not name.startswith(PKG + "."):
        return False
    rel = Path(*name[len(PKG) + 1:].split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        yield ".".join([PKG, *parts]), path


def graph() -> dict[str, set[str]]:
    return {m: imports_of(p.read_text(), m, p.name == "__init__.py") - {m}
            for m, p in modules()}


def folder_of(module: str) -> str:
    parts = module[len(PKG) + 1:].split(".") if module != PKG else []
    return parts[0] if len(parts) > 1 and parts[0] in FOLDERS else ""


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize(("edges", "expected"), [
    ({"a": {"b"}, "b": set()}, []),
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"a"}}, [["a", "b", "c", "d"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"b"}}, [["b", "c"]]),
])
def test_circles_finds_every_loop(edges: dict[str, set[str]], expected: list[list[str]]
                                  ) -> None:
    assert circles(edges) == expected


@pytest.mark.parametrize(("source", "module", "expected"), [
    ("from mtc.sidecar.replicator.copies import gc", f"{PKG}.node", {f"{PKG}.copies.gc"}),
    ("from mtc.sidecar.replicator.store.store import LocalStore", f"{PKG}.node",
     {f"{PKG}.store.store"}),
    ("if TYPE_CHECKING:\n    from mtc.sidecar.replicator.wire.client import PeerClient\n",
     f"{PKG}.fetch.restore", {f"{PKG}.wire.client"}),
    ("def f():\n    import mtc.sidecar.replicator.wire.server\n", f"{PKG}.node",
     {f"{PKG}.wire.server"}),
    ("from . import gc", f"{PKG}.copies.scrub", {f"{PKG}.copies.gc"}),
    ("from ..store.store import LocalStore", f"{PKG}.copies.scrub", {f"{PKG}.store.store"}),
    ("from mtc.errors import MtcError", f"{PKG}.node", set()),
])
def test_imports_of_reads_every_form(source: str, module: str, expected: set[str]) -> None:
    assert imports_of(source, module) == expected


def test_no_circle_between_the_replicators_folders() -> None:
    between: dict[str, set[str]] = {}
    for m, deps in graph().items():
        a = folder_of(m)
        for d in deps:
            b = folder_of(d)
            if a and b and a != b:
                between.setdefault(a, set()).add(b)
    assert circles(between) == []


def test_no_circle_between_the_replicators_modules() -> None:
    assert circles(graph()) == []


def test_the_replicators_logic_never_imports_wire() -> None:
    direct = sorted((m, d) for m, deps in graph().items() if folder_of(m) in LOGIC
                    for d in deps if folder_of(d) == "wire")
    assert direct == [], "the logic reaches its peers through transport.py, not wire/"
