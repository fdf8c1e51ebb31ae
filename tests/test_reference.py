"""docs/reference.md against the code: a row for every error and every
``mtc-replicator`` flag; and the README's and docs' links lead somewhere (a
heading of the page, a file of the repository). ``scripts/reference_tables.py
--write`` writes the two tables again."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

import mtc.errors
from mtc.sidecar.replicator import main as replicator_main

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "reference.md"


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def first_column(table: str) -> set[str]:
    return set(re.findall(r"^\| `([^` ]+)[^`]*` \|", table, flags=re.M))


def test_every_error_has_a_row() -> None:
    errors = {n for n, c in vars(mtc.errors).items()
              if inspect.isclass(c) and issubclass(c, mtc.errors.MtcError)}
    assert first_column(section(REFERENCE.read_text(), "## Errors")) == errors


def test_every_replicator_flag_has_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    parsers: list[argparse.ArgumentParser] = []

    def keep(self: argparse.ArgumentParser, *_: object, **__: object) -> None:
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", keep)
    with pytest.raises(SystemExit):
        replicator_main.parse_args([])
    flags = {a.option_strings[0] for a in parsers[0]._actions
             if a.option_strings and a.dest != "help"}
    assert first_column(section(REFERENCE.read_text(), "## `mtc-replicator` flags")) == flags


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", ["README.md", *sorted(
    f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))])
def test_links_lead_somewhere(page: str) -> None:
    path = REPO / page
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # not code
    anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        if file:
            assert (path.parent / file).exists(), f"{page}: {target} is no file"
        elif anchor:
            assert anchor in anchors, f"{page}: no heading #{anchor}"


# A path of the repository named in backquotes: `sidecar/replicator/copies/`, `mtc/save/stage.py`.
REPO_PATH = re.compile(r"`((?:mtc|sidecar|tests|bench|trainer|deploy|scripts|docs|proto)/"
                       r"[\w./-]*)`")


@pytest.mark.parametrize("page", ["README.md", *sorted(
    f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))])
def test_paths_named_exist(page: str) -> None:
    """Every folder and file of the repository a page names is there (the README's
    stages of the data path among them): a module moved leaves no stale name."""
    named = REPO_PATH.findall((REPO / page).read_text())
    assert [p for p in named if not (REPO / p).exists()] == []
    if page == "README.md":  # the check finds what it looks for
        assert "sidecar/replicator/copies/" in named
