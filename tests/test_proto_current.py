"""The generated protobuf code in mtc/proto/ matches proto/ (regenerate: scripts/gen_proto.sh),
and the runtime floors pyproject.toml states satisfy the checks that code makes on import."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent

# The generator stamps its own version into the code (grpcio-tools' GRPC_GENERATED_VERSION,
# protoc's "Protobuf Python Version" and runtime check). A patch release of the generator
# changes only these lines; the code stays current with proto/ and keeps the floor it was
# generated for, which test_the_stated_floors_satisfy_the_generated_codes_checks holds to.
_GRPC_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.M)
_PROTOBUF_STAMP = re.compile(r"^# Protobuf Python Version: ([0-9.]+)$", re.M)
_PROTOBUF_CHECK = re.compile(
    r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)"
    r"\s*(\d+),\s*(\d+),\s*(\d+),")


def _unstamped(text: str) -> str:
    text = _GRPC_STAMP.sub("GRPC_GENERATED_VERSION = '<stamp>'", text)
    text = _PROTOBUF_STAMP.sub("# Protobuf Python Version: <stamp>", text)
    return _PROTOBUF_CHECK.sub(r"\1 <stamp>,", text)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _checked_in() -> dict[str, str]:
    return {p.name: p.read_text() for p in (ROOT / "mtc" / "proto").iterdir() if p.is_file()}


def test_generated_code_is_current(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(out)], check=True,
                   cwd=ROOT, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    checked_in = _checked_in()
    fresh = {p.name: p.read_text() for p in out.iterdir() if p.is_file()}
    assert set(fresh) == set(checked_in), "run scripts/gen_proto.sh"
    stale = [name for name in fresh if _unstamped(fresh[name]) != _unstamped(checked_in[name])]
    assert not stale, f"stale generated code {stale}: run scripts/gen_proto.sh"


def test_unstamping_hides_only_the_generators_version() -> None:
    code = _checked_in()
    grpc_code = code["replicator_pb2_grpc.py"]
    assert _GRPC_STAMP.search(grpc_code), "the grpc stamp moved: update _GRPC_STAMP"
    pb2 = code["replicator_pb2.py"]
    assert _PROTOBUF_CHECK.search(pb2), "the protobuf check moved: update _PROTOBUF_CHECK"
    assert _unstamped(grpc_code.replace("1.85", "1.99")) == _unstamped(grpc_code)
    # Anything else that differs is still seen.
    renamed = grpc_code.replace("ReplicatorStub", "OtherStub")
    assert _unstamped(renamed) != _unstamped(grpc_code)


def _floor(requirements: list[str], name: str) -> tuple[int, ...]:
    for requirement in requirements:
        match = re.fullmatch(rf"{re.escape(name)}>=([0-9.]+)(,.*)?", requirement.strip())
        if match:
            return _version(match.group(1))
    raise AssertionError(f"pyproject.toml states no floor for {name}")


def test_the_stated_floors_satisfy_the_generated_codes_checks() -> None:
    """The generated code refuses to import under a grpcio older than the grpcio-tools
    that made it, and under a protobuf older than its protoc: pyproject.toml's floors
    must be at least those, or the oldest install it admits cannot import mtc."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    code = _checked_in()
    grpc_stamp = _GRPC_STAMP.search(code["replicator_pb2_grpc.py"])
    protobuf_check = _PROTOBUF_CHECK.search(code["replicator_pb2.py"])
    assert grpc_stamp and protobuf_check
    generated_grpc = _version(grpc_stamp.group(1))
    generated_protobuf = tuple(int(protobuf_check.group(i)) for i in (2, 3, 4))
    assert _floor(project["dependencies"], "grpcio") >= generated_grpc
    assert _floor(project["optional-dependencies"]["dev"], "grpcio-tools") >= generated_grpc
    assert _floor(project["dependencies"], "protobuf") >= generated_protobuf
