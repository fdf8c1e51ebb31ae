"""mtc.testing's conditions and assertions, alone (table tests: no process, no cluster)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mtc.testing import Restore, assert_same_values, assert_tiers
from mtc.testing.checks import tier_problems, value_problems
from mtc.testing.replicas import unreplicated

SLICES_2x2 = [0, 0, 1, 1]


@pytest.mark.parametrize(("held", "missing"), [
    ({}, [0, 1, 2, 3]),
    # each host's own copy does not count: a copy must be in another slice
    ({h: {(h, 5)} for h in range(4)}, [0, 1, 2, 3]),
    ({0: {(2, 5)}, 1: {(3, 5)}, 2: {(0, 5)}, 3: {(1, 5)}}, []),
    # host 1 holds host 0's step: the same slice, it does not count
    ({1: {(0, 5)}, 3: {(1, 5)}}, [0, 2, 3]),
    ({1: {(0, 5)}, 2: {(0, 5), (1, 5)}, 3: {(1, 5)}}, [2, 3]),
    ({0: {(2, 4), (3, 5)}, 2: {(0, 5), (1, 5)}}, [2]),  # another step is not this one
])
def test_unreplicated(held: dict[int, set[tuple[int, int]]], missing: list[int]) -> None:
    assert unreplicated(held, 5, SLICES_2x2) == missing


@pytest.mark.parametrize(("got", "want", "problems"), [
    ({0: "local", 1: "peer"}, {0: "local", 1: "peer"}, []),
    ({0: "local", 1: "peer"}, {1: "peer"}, []),  # hosts left out are not checked
    ({0: "local", 1: "peer"}, "local", ["host 1: peer (wanted local)"]),
    ({0: "local"}, {1: "backup"}, ["host 1: nothing restored (wanted backup)"]),
])
def test_tier_problems(got: dict[int, str], want: dict[int, str] | str,
                       problems: list[str]) -> None:
    assert tier_problems(got, want) == problems


def test_an_unknown_tier_is_refused() -> None:
    with pytest.raises(ValueError, match="'disk'"):
        tier_problems({0: "local"}, "disk")


def test_assert_tiers_names_the_host() -> None:
    assert_tiers(Restore(3, {0: "local", 1: "peer"}), {1: "peer"})
    with pytest.raises(AssertionError, match=r"host 1: peer \(wanted local\)"):
        assert_tiers(Restore(3, {0: "local", 1: "peer"}), "local")


def test_value_problems_name_the_leaf() -> None:
    a = {"w": jnp.arange(6.0).reshape(2, 3), "step": 3, "n": [np.float32(np.nan)]}
    assert value_problems(a, {"w": jnp.arange(6.0).reshape(2, 3), "step": 3,
                              "n": [np.float32(np.nan)]}) == []  # NaN equals NaN
    assert value_problems(a, {**a, "w": a["w"].at[1, 2].add(1e-6)}) == [
        "['w']: 1 of 6 elements differ"]
    assert value_problems(a, {**a, "w": a["w"].astype(jnp.int32)}) == [
        "['w']: float32[2, 3] != int32[2, 3]"]
    assert value_problems(a, {**a, "step": 4}) == ["['step']: 1 of 1 elements differ"]
    assert value_problems(a, {"w": a["w"]})[0].startswith("tree structure differs")
    with pytest.raises(AssertionError, match=r"\['step'\]"):
        assert_same_values(a, {**a, "step": 4})
