"""mtc.testing's conditions and assertions, alone (table tests: no process, no cluster)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mtc.testing import Restore, assert_same_values, assert_tiers
from mtc.testing.checks import tier_problems, value_problems


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
