"""Every mtc command the README and docs/*.md show parses with that command's own
argument parser (issue 68, item 9: a command that runs only with a flag the page
leaves out). Fenced shell blocks, command by command (continuations joined,
``sudo``/``kubectl exec ... --`` and variable assignments before the command
skipped), and inline spans that give a command with flags. Parsing only: nothing
runs, no process starts."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]

# The installed commands (pyproject.toml's [project.scripts]) and the modules the
# pages run with ``python -m``: where each one's main() is.
COMMANDS = {
    "mtc": "mtc.cli",
    "mtc-replicator": "mtc.sidecar.replicator.main",
    "mtc-cluster": "mtc.trainer.cluster",
    "mtc-demo": "mtc.trainer.elastic_demo",
    "mtc-replicator-k8s": "mtc.sidecar.replicator.k8s",
    "mtc-train-k8s": "mtc.trainer.k8s",
}
MODULES = {"mtc.cli", "mtc.trainer.cluster", "mtc.trainer.elastic", "mtc.trainer.chaos",
           "mtc.trainer.elastic_demo", "mtc.sidecar.host.main",
           "mtc.sidecar.replicator.main", "mtc.sidecar.replicator.healthcheck"}
# Inline spans that name a command and a flag without being a command to type: a
# synopsis with placeholders, or one flag named in a sentence.
NOT_COMMANDS = {
    "mtc certs --out DIR --ranks N --hosts ADDR0,ADDR1,...",  # README: the synopsis
    "mtc certs --out DIR --ranks N [--hosts A0,A1,...] [--controller-name NAME] [--days D]",
    "mtc-train-k8s --mode=pathways", "mtc-train-k8s --mode=multi-controller",
    "mtc-replicator-k8s --write-jax-init-info", "mtc-replicator-k8s --print-args",
    "mtc-replicator-k8s --health-port 9471",  # deploy.md: flags of the pods' command
    "mtc status --local-dir",  # reference.md: the command named in a sentence
}
WRAPPERS = {"sudo", "nohup", "exec", "env", "time"}
OPERATORS = {"&&", "||", ";", "|", "&"}


def commands_of(line: str) -> Iterator[tuple[str, list[str]]]:
    """The mtc commands of one shell line: (the command or ``-m`` module, its args)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    simple: list[str] = []
    for token in [*lexer, ";"]:
        if token not in OPERATORS:
            simple.append(token)
            continue
        words, simple = simple, []
        if words[:2] == ["kubectl", "-n"] or words[:1] == ["kubectl"]:
            words = words[words.index("--") + 1:] if "--" in words else []
        while words and (words[0] in WRAPPERS or re.fullmatch(r"\w+=.*", words[0])
                         or (words[0].startswith("-") and simple == [])):
            words = words[1:]
        while words and words[0].startswith("-"):  # sudo's own flags
            words = words[1:]
        if not words:
            continue
        name = Path(words[0]).name
        if name in COMMANDS:
            yield name, cut(words[1:])
        elif re.fullmatch(r"python3?(\.\d+)?", name) and words[1:2] == ["-m"] and \
                len(words) > 2 and words[2].startswith("mtc."):
            yield words[2], cut(words[3:])


def cut(args: list[str]) -> list[str]:
    """The arguments before a redirection (``> file``, ``2>&1``)."""
    out = []
    for a in args:
        if re.fullmatch(r"\d*[<>].*", a):
            break
        out.append(a)
    return out


def shell_commands(page: str) -> list[tuple[str, list[str]]]:
    text = (REPO / page).read_text()
    found = []
    for m in re.finditer(r"```(sh|bash|shell|console)\n(.*?)```", text, re.S):
        body = re.sub(r"\\\n", " ", m.group(2))
        for line in body.splitlines():
            found += commands_of(line.removeprefix("$ "))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`]+)`", re.sub(r"\s*\n\s*", " ", prose)):
        if " -" in span and span not in NOT_COMMANDS and not span.startswith("mtc."):
            found += [c for c in commands_of(span) if c[1]]
    return found


class _Parsed(Exception):
    pass


def parse_with_own_parser(command: str, args: list[str]) -> None:
    """Run the command's main() up to its argument parser: an error there (argparse's
    SystemExit 2) fails; a parse that succeeds stops it before anything runs."""
    module = importlib.import_module(COMMANDS.get(command, command))
    if command == "mtc-replicator-k8s":  # its own flags, then the rest mtc-replicator's
        _, rest = module.parse_args(args, env={})
        from mtc.sidecar.replicator import main as replicator

        computed = ["--listen", "0.0.0.0:1", "--nodes", "a:1", "--rank", "0"]
        run: Callable[[], object] = lambda: replicator.parse_args(  # noqa: E731
            ["--local-dir", "/x", *computed, *rest])
    else:
        run = lambda: module.main(args)  # noqa: E731
    real = argparse.ArgumentParser.parse_args

    def parse_only(self: argparse.ArgumentParser, *a: object, **kw: object) -> None:
        real(self, *a, **kw)  # type: ignore[arg-type]
        raise _Parsed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", parse_only)
        try:
            run()
        except _Parsed:
            return
    raise AssertionError(f"{command} {shlex.join(args)}: main() ran past its parser")


@pytest.mark.parametrize("page", PAGES)
def test_every_mtc_command_on_the_page_parses(page: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    bad = []
    for command, args in shell_commands(page):
        try:
            parse_with_own_parser(command, args)
        except SystemExit as e:
            if e.code == 0:  # --help: printed, and a success
                continue
            bad.append(f"{command} {shlex.join(args)}: exit {e.code}: "
                       f"{capsys.readouterr().err.strip().splitlines()[-1:]}")
    assert bad == []


def test_the_commands_are_found() -> None:
    """The extraction finds what the pages show (else the test above checks nothing)."""
    mc = shell_commands("docs/multi-controller.md")
    assert ("mtc", ["certs", "--out", "pki", "--ranks", "4", "--hosts",
                    "10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5"]) in mc
    assert [c for c, a in mc if a[:1] == ["backup"]] == ["mtc"]
    assert "mtc-replicator" in {c for c, _ in mc}  # the unit's command line
    ops = shell_commands("docs/operations.md")
    assert any(c == "mtc" and a[:1] == ["status"] for c, a in ops)  # after kubectl exec --
    assert not any(c == "mtc-replicator" for c, _ in commands_of(
        "sudo systemctl enable --now mtc-replicator"))  # a unit's name, not the command
    assert list(commands_of("sudo /opt/mtc/bin/mtc status --nodes a:1 > out.txt")) == [
        ("mtc", ["status", "--nodes", "a:1"])]
    assert sys.modules.get("mtc") is not None
