"""Deployment, the images (no Docker engine here): every ``COPY`` source exists and
is in the build context; both images share the Python base and install the same
pinned requirements, whose jax and jaxlib are pyproject's; each image's
entrypoint and health check import and answer ``--help`` here."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_render import (
    DEPLOY,
    DOCKERFILES,
    OVERLAYS,
    PYPROJECT,
    REPO,
    lock,
)
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from replicators import env_with_repo

# Every test here reads the images' files or runs their tools.
pytestmark = pytest.mark.process


# -- the images -------------------------------------------------------------------------------


def instructions(dockerfile: Path) -> list[tuple[str, str, str | None]]:
    """(INSTRUCTION, arguments, stage) with continuations joined and comments dropped."""
    out: list[tuple[str, str, str | None]] = []
    stage: str | None = None
    buf = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        word = word.upper()
        if word == "FROM":
            m = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)
            stage = m.group(1) if m else None
        out.append((word, rest.strip(), stage))
        buf = ""
    return out


def final_stages(dockerfile: Path) -> dict[str | None, list[tuple[str, str]]]:
    """Instructions of each stage that is an image (not the wheel build stage)."""
    stages: dict[str | None, list[tuple[str, str]]] = {}
    for word, rest, stage in instructions(dockerfile):
        stages.setdefault(stage, []).append((word, rest))
    return {s: ins for s, ins in stages.items() if s != "wheel" and any(
        w == "FROM" for w, _ in ins)}


def args_of(dockerfile: Path) -> dict[str, str]:
    return {k: v for w, rest, _ in instructions(dockerfile) if w == "ARG" and "=" in rest
            for k, v in [rest.split("=", 1)]}


def dockerignored(path: str) -> bool:
    """Whether Docker's .dockerignore rules (last match wins, parents count) exclude path."""
    rules = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_copy_sources_exist_in_the_build_context(name: str) -> None:
    copies = [rest for w, rest, _ in instructions(DOCKERFILES[name])
              if w in ("COPY", "ADD") and "--from=" not in rest]
    assert copies
    for rest in copies:
        *sources, _dest = [a for a in shlex.split(rest) if not a.startswith("--")]
        for src in sources:
            assert (REPO / src).exists(), f"{name}: COPY source {src} does not exist"
            assert not dockerignored(src.rstrip("/")), f"{name}: {src} is in .dockerignore"
            for f in (REPO / src).rglob("*.py") if (REPO / src).is_dir() else []:
                rel = f.relative_to(REPO).as_posix()
                assert not dockerignored(rel), f"{name}: {rel} is left out by .dockerignore"


def test_dockerignore_keeps_the_context_small() -> None:
    for path in (".venv/bin/python", "out/demo", ".git/HEAD", "tests/test_deploy_images.py",
                 "mtc/__pycache__/x.pyc"):
        assert dockerignored(path), path


def requirement(name: str) -> Requirement:
    for spec in PYPROJECT["project"]["dependencies"]:
        req = Requirement(spec)
        if req.name == name:
            return req
    raise AssertionError(f"{name} is not a dependency in pyproject.toml")


def test_library_states_ranges_and_leaves_the_demo_out() -> None:
    """A library states the versions it works with; exact pins are the images' lock."""
    for name in ("jax", "jaxlib", "orbax-checkpoint", "pathwaysutils"):
        ops = {s.operator for s in requirement(name).specifier}
        assert ops == {">=", "<"}, f"{name}: a range, not {requirement(name).specifier}"
    assert requirement("jax").specifier == requirement("jaxlib").specifier
    names = {Requirement(r).name for r in PYPROJECT["project"]["dependencies"]}
    assert not names & {"optax", "matplotlib"}, "the trainers' dependencies are extras"
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert any(Requirement(r).name == "optax" for r in extras["trainer"])


def test_images_share_python_and_pinned_requirements() -> None:
    a, b = args_of(DOCKERFILES["sidecar"]), args_of(DOCKERFILES["trainer"])
    assert a["PYTHON_IMAGE"] == b["PYTHON_IMAGE"]
    assert a["PYTHON_VERSION"] == b["PYTHON_VERSION"]
    m = re.fullmatch(r"python:(\d+\.\d+)[.\d]*-slim.*", a["PYTHON_IMAGE"])
    assert m and m.group(1) == a["PYTHON_VERSION"], a["PYTHON_IMAGE"]
    # Google's colocated-Python sidecar bases are Python 3.12: so is every image.
    assert a["PYTHON_VERSION"] == "3.12"
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(a["PYTHON_VERSION"])
    for df in DOCKERFILES.values():
        for stage, ins in final_stages(df).items():
            text = "\n".join(rest for _, rest in ins)
            assert "requirements.txt" in text and "check_image.py" in text, (df.name, stage)
            assert '--python "$PYTHON_VERSION"' in text, (df.name, stage)
            assert any(w == "ARG" and r.startswith("PYTHON_VERSION") for w, r in ins), stage
    locked = lock()
    assert locked["jax"] == locked["jaxlib"]
    # Every runtime dependency (the trainer image's extra too) is locked at a
    # version pyproject allows.
    for spec in [*PYPROJECT["project"]["dependencies"],
                 *PYPROJECT["project"]["optional-dependencies"]["trainer"]]:
        req = Requirement(spec)
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        assert key in locked, f"{req.name} is not in deploy/requirements.txt"
        assert req.specifier.contains(locked[key], prereleases=True), (req, locked[key])


def test_check_image_guards_the_build(tmp_path: Path) -> None:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    script = str(DEPLOY / "check_image.py")
    ok = subprocess.run([sys.executable, script, "--python", py, "--requirements",
                         str(DEPLOY / "requirements.txt")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "req.txt"
    bad.write_text("jax==0.0.1\n")
    out = subprocess.run([sys.executable, script, "--python", "2.7", "--requirements",
                          str(bad)], capture_output=True, text=True)
    assert out.returncode == 1
    assert "Python" in out.stderr and "jax" in out.stderr and "jaxlib is not pinned" in out.stderr
    # PyPI's jaxlib (as here) lacks the colocated-Python client of Google's bases.
    colo = subprocess.run([sys.executable, script, "--python", py, "--requirements",
                           str(DEPLOY / "requirements.txt"), "--colocated-server"],
                          capture_output=True, text=True)
    assert colo.returncode == 1 and "colocated_python_cpu_client" in colo.stderr, colo.stderr


def test_colocated_image_keeps_the_bases_jax() -> None:
    """The colocated-Python target installs mtc under the base's constraints (the base's
    jax, jaxlib, protobuf and grpc stay) and checks them against the trainer's lock."""
    stages = final_stages(DOCKERFILES["sidecar"])
    text = "\n".join(rest for _, rest in stages["colocated-python"])
    assert "server_constraints.txt" in args_of(DOCKERFILES["sidecar"])["BASE_CONSTRAINTS"]
    assert '-c "$BASE_CONSTRAINTS"' in text
    assert "--no-deps -r" not in text, "installing the lock would replace the base's jax"
    assert "--colocated-server" in text
    assert any(w == "FROM" and r.startswith("${COLOCATED_BASE}")
               for w, r in stages["colocated-python"])


def test_the_example_bases_take_mtc() -> None:
    """Every colocated-Python base tag Dockerfile.sidecar names as an example carries a
    jax that pyproject allows, and the one it says to pick is the trainer image's."""
    text = DOCKERFILES["sidecar"].read_text()
    named = re.findall(r"jax_(\d+\.\d+\.\d+)", text)
    assert named, "Dockerfile.sidecar names no example base"
    allowed = requirement("jax").specifier
    for v in named:
        assert allowed.contains(v), f"example base with jax {v}: below mtc's {allowed}"
    assert lock()["jax"] in named


def test_images_run_as_non_root_with_health_checks() -> None:
    for df in DOCKERFILES.values():
        for stage, ins in final_stages(df).items():
            users = [r for w, r in ins if w == "USER"]
            assert users and users[-1].split(":")[0] not in ("root", "0"), (df.name, stage)
            assert any(w == "HEALTHCHECK" for w, _ in ins), (df.name, stage)


def _exec_form(rest: str) -> list[str]:
    rest = re.sub(r"^(--\S+\s+)*", "", rest)
    if rest.startswith("CMD "):
        rest = rest[4:]
    return list(json.loads(rest))


def _python_argv(argv: list[str]) -> list[str]:
    """An image command as a command here: console scripts through their module."""
    scripts = PYPROJECT["project"]["scripts"]
    if argv[0] in scripts:
        module = scripts[argv[0]].split(":")[0]
        return [sys.executable, "-m", module, *argv[1:]]
    assert argv[0] == "python", argv
    return [sys.executable, *argv[1:]]


def _entry_commands() -> list[tuple[str, list[str]]]:
    found = []
    for df in DOCKERFILES.values():
        for stage, ins in final_stages(df).items():
            for w, rest in ins:
                if w in ("ENTRYPOINT", "HEALTHCHECK"):
                    found.append((f"{df.name}:{stage}:{w}", _python_argv(_exec_form(rest))))
    return found


@pytest.mark.parametrize(("where", "argv"), _entry_commands(), ids=lambda x: x
                         if isinstance(x, str) else "")
def test_entrypoints_and_health_checks_answer_help(where: str, argv: list[str]) -> None:
    if argv[1] == "-c":
        # An inline health check: it must at least compile.
        compile(argv[2], where, "exec")
        return
    out = subprocess.run([*argv[:3], "--help"], capture_output=True, text=True, timeout=60,
                         env=env_with_repo(), cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_image_modules_import() -> None:
    """What each image runs imports here: the trainer's loop, the replicator, the host side."""
    modules = ["mtc.trainer.k8s", "mtc.trainer.model", "mtc.trainer.data", "mtc", "mtc.replicas",
               "mtc.sidecar.replicator.k8s", "mtc.sidecar.replicator.main",
               "mtc.sidecar.replicator.healthcheck",
               "mtc.sidecar.save.agent", "mtc.sidecar.colocated"]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True,
                         timeout=120, env={**env_with_repo(), "JAX_PLATFORMS": "cpu"}, cwd=REPO)
    assert out.returncode == 0, out.stderr


def test_image_entrypoints_are_console_scripts() -> None:
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts["mtc-replicator-k8s"] == "mtc.sidecar.replicator.k8s:main"
    assert scripts["mtc-train-k8s"] == "mtc.trainer.k8s:main"
    entry = {df.name: [_exec_form(r) for s, ins in final_stages(df).items()
                       for w, r in ins if w == "ENTRYPOINT"] for df in DOCKERFILES.values()}
    assert entry["Dockerfile.sidecar"] == [["mtc-replicator-k8s"]]
    assert entry["Dockerfile.trainer"] == [["mtc-train-k8s"]]


def test_deploy_guide_is_linked() -> None:
    guide = REPO / "docs" / "deploy.md"
    assert guide.is_file()
    assert "docs/deploy.md" in (REPO / "README.md").read_text()
    text = guide.read_text()
    for overlay in OVERLAYS:
        assert f"deploy/overlays/{overlay.name}" in text, overlay.name
    assert fnmatch.fnmatch(text, "*jax-init-info.txt*")
    # The upgrade rule of the on-disk formats, and the test that holds a release to it.
    assert "\n## Upgrades\n" in text and "tests/test_manifest_upgrade.py" in text
    assert (REPO / "tests" / "test_manifest_upgrade.py").is_file()
    assert "docs/operations.md" in (REPO / "README.md").read_text()
