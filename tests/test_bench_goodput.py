"""The goodput benchmark's noise floor (bench/goodput.py): the uninterrupted
reference run's steps, scored by the median-step ideal the run's figure uses."""

from __future__ import annotations

import pytest

from bench.goodput import noise_floor


def _steps(meshes: dict[int, list[int]]) -> list[dict[str, object]]:
    return [{"step": s, "slices": mesh} for s, mesh in sorted(meshes.items())]


def test_a_jittery_reference_scores_its_median_over_its_time() -> None:
    steady = _steps({2: [0, 1], 3: [0, 1], 4: [0, 1], 5: [0, 1]})
    ref = {"step_s": [9.0, 1.0, 1.0, 1.0, 3.0]}  # step 1 (start-up) is not steady
    assert noise_floor(steady, ref) == pytest.approx(4 / 6)


def test_each_mesh_is_scored_by_its_own_median_step() -> None:
    # One slice runs at 2 s a step, both at 1 s: neither is jitter.
    steady = _steps({1: [0, 1], 2: [0, 1], 3: [0], 4: [0], 5: [0]})
    assert noise_floor(steady, {"step_s": [1.0, 1.0, 2.0, 2.0, 2.0]}) == pytest.approx(1.0)
    # The one-slice steps' skew alone counts: their median 2 s, where they took 9.
    assert noise_floor(steady, {"step_s": [1.0, 1.0, 2.0, 2.0, 5.0]}) == pytest.approx(
        (2 * 1.0 + 3 * 2.0) / (2.0 + 9.0))


def test_without_a_reference_there_is_no_floor() -> None:
    steady = _steps({1: [0, 1]})
    assert noise_floor(steady, None) is None
    assert noise_floor(steady, {"losses": [1.0]}) is None
