"""The children of the local cluster and the demos import an installed mtc before
the checkout's folders (on a host where mtc is a wheel, the checkout would shadow
it: only an install maps sidecar/ and trainer/ into the package)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mtc.testing.isolation import with_checkout
from mtc.trainer.demo import child_env

CHECKOUT = str(Path(__file__).resolve().parents[1])


def test_checkout_goes_after_what_is_on_the_path() -> None:
    env = with_checkout({"PYTHONPATH": os.pathsep.join(["/opt/deps", "/opt/jax"]), "X": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == ["/opt/deps", "/opt/jax", CHECKOUT]
    assert env["X"] == "1"
    assert env["PYTHONSAFEPATH"] == "1"  # a child started in the checkout: not first either


def test_alone_when_nothing_is_on_the_path_and_never_twice() -> None:
    assert with_checkout({})["PYTHONPATH"] == CHECKOUT
    twice = with_checkout(with_checkout({"PYTHONPATH": "/opt/deps"}))
    assert twice["PYTHONPATH"].split(os.pathsep) == ["/opt/deps", CHECKOUT]


def test_the_demos_children_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/opt/deps")
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert child_env()["PYTHONPATH"].split(os.pathsep) == ["/opt/deps", CHECKOUT]
