"""The goodput benchmark's noise floor (bench/goodput.py): the uninterrupted
reference run's steps, scored by the median-step ideal the run's figure uses;
and each core's steal, the time the hypervisor gave to others (bench/_cpu.py)."""

from __future__ import annotations

import pytest

from bench._cpu import CpuSampler, core_ticks
from bench._goodput_figures import noise_floor


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


def test_steal_is_each_cores_share_of_its_ticks_within_the_window() -> None:
    ticks = core_ticks()  # this machine's, read from /proc/stat (online cores only)
    assert ticks and all(k >= 0 for k in ticks)
    assert all(0 <= steal <= total for steal, total in ticks.values())
    cpu = CpuSampler(lambda: {})
    cpu.cores = [(1.0, {0: (10, 1000), 1: (0, 1000)}),
                 (2.0, {0: (15, 1100), 1: (50, 1100)}),
                 (3.0, {0: (35, 1200), 1: (50, 1200)})]
    assert cpu.steal(1.5, 3.5) == {0: 0.2, 1: 0.0}  # core 0: 20 of 100 ticks
    assert cpu.steal(0.0, 3.0) == {0: 0.125, 1: 0.25}
    assert cpu.steal(2.5, 3.5) == {}  # one sample: no window


def test_a_run_that_ends_before_its_steady_state_says_so() -> None:
    from bench._goodput_figures import analyse

    steps = [{"step": s, "loss": 1.0, "step_s": 0.5, "t": 100.0 + s, "slices": [0, 1],
              "saved": False} for s in range(1, 6)]
    records = [{"event": "start", "t": 99.0}, *steps,
               # The compile ahead the first step started ends after the last step.
               {"event": "compiled_ahead", "slices": [0], "program": "snapshot",
                "source": "compiled", "seconds": 9.0, "t": 110.0},
               {"event": "trained", "t": 105.5, "recoveries": []}]
    with pytest.raises(SystemExit, match=r"no step started in steady state.*--steps"):
        analyse(records, 98.0)
