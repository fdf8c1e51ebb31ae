"""docs/reference.md's tables made from the code: every error (mtc.errors) and every
``mtc-replicator`` flag (its parser's help). ``tests/test_reference.py`` fails when
one is missing; this writes them again:

    .venv/bin/python scripts/reference_tables.py          # print both tables
    .venv/bin/python scripts/reference_tables.py --write  # replace them in the page
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import mtc.errors
from mtc.sidecar.replicator import main as replicator_main

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"


def replicator_parser() -> argparse.ArgumentParser:
    """The parser ``mtc-replicator`` builds (its ``parse_args`` builds and runs it)."""
    got: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_args

    def keep(self: argparse.ArgumentParser, *_: object, **__: object) -> argparse.Namespace:
        got.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = keep  # type: ignore[assignment,method-assign]
    try:
        replicator_main.parse_args([])
    except SystemExit:
        pass
    finally:
        argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]
    return got[0]


def flags_table() -> str:
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for a in replicator_parser()._actions:
        if not a.option_strings or a.dest == "help":
            continue
        flag = a.option_strings[0] + (" {" + ",".join(a.choices) + "}" if a.choices else "")
        default = "required" if a.required else (
            "" if a.default is None or a.default is False else f"`{a.default}`")
        meaning = (a.help or "").replace("|", "\\|")
        if a.dest == "log_level":
            meaning = "the log level (Python's logging names)"
        rows.append(f"| `{flag}` | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


def errors_table() -> str:
    rows = ["| error | derives from | meaning |", "|---|---|---|"]
    for name, cls in vars(mtc.errors).items():
        if inspect.isclass(cls) and issubclass(cls, mtc.errors.MtcError):
            first = " ".join((cls.__doc__ or "").split()).split(". ")[0].rstrip(".") + "."
            parent = "" if cls is mtc.errors.MtcError else cls.__mro__[1].__name__
            rows.append(f"| `{name}` | {parent} | {first.replace('``', '`')} |")
    return "\n".join(rows) + "\n"


def replace_table(page: str, heading: str, first_row: str, table: str) -> str:
    """``page`` with the table that starts with ``first_row`` under ``heading`` replaced."""
    start = page.index(first_row, page.index(heading))
    end = page.index("\n\n", start) + 1
    return page[:start] + table + page[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"replace them in {REFERENCE.name}")
    args = p.parse_args(argv)
    if not args.write:
        print(errors_table() + "\n" + flags_table(), end="")
        return 0
    page = REFERENCE.read_text()
    page = replace_table(page, "## Errors", "| error |", errors_table())
    page = replace_table(page, "## `mtc-replicator` flags", "| flag |", flags_table())
    REFERENCE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
