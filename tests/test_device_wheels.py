"""scripts/device_wheels.py: which distributions ship to an accelerator host."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_wheels.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_wheels", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GRAPH = {
    "mtc": ["jax>=0.10", "Orbax_Checkpoint>=0.12", "grpcio", "pytest; extra == 'dev'",
            "optax; extra == 'trainer'", "tomli; python_version < '3.0'"],
    "jax": ["numpy", "jaxlib"],
    "orbax-checkpoint": ["jax", "tensorstore", "protobuf"],
    "tensorstore": ["numpy", "ml_dtypes"],
    "grpcio": ["protobuf"],
    "protobuf": [],
    "pytest": ["pluggy"],
    "optax": ["jax", "absl-py"],
}


def test_the_closure_follows_requirements_and_leaves_out_what_the_host_keeps() -> None:
    closure = _script().closure("mtc", lambda n: GRAPH.get(n, []))
    # Names normalized; extras and markers false here dropped; JAX and what only
    # it brings left to the host; what another package needs (tensorstore, for
    # Orbax) shipped even where the host's JAX once had it.
    assert closure == ["grpcio", "orbax-checkpoint", "protobuf", "tensorstore"]


def test_an_extra_of_mtc_adds_its_requirements_and_theirs_only() -> None:
    closure = _script().closure("mtc", lambda n: GRAPH.get(n, []), extras=["trainer"])
    # The trainer's optax and what it needs beyond the host's JAX; not dev's pytest.
    assert closure == ["absl-py", "grpcio", "optax", "orbax-checkpoint", "protobuf",
                       "tensorstore"]


def test_the_closure_of_the_installed_mtc_has_its_runtime_dependencies_only() -> None:
    module = _script()
    closure = module.closure("mtc", module._installed_requires)
    assert {"grpcio", "protobuf", "orbax-checkpoint", "google-crc32c"} <= set(closure)
    assert not {"jax", "jaxlib", "numpy", "pytest", "ruff", "mypy", "mtc"} & set(closure)
