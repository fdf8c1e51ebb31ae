"""A controller that planned around hosts whose data is still arriving waits for
them within its restore timeout: a pending host that does not list the agreed step
yet is asked again, never reported as a step that is not committed; a host that was
not pending, or one still missing at the deadline, is reported at once, typed.

The policy alone (``StepReader._saved_once_listed``): the listing is a stand-in
whose answers the test scripts (the process tests restore through the real one:
``tests/test_backup_tier.py``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from mtc.errors import StepNotFoundError
from mtc.restore import step as step_mod
from mtc.restore.step import StepReader


def reader(answers: list[Any], monkeypatch: pytest.MonkeyPatch) -> tuple[StepReader, list[int]]:
    """A reader whose ``saved_step`` gives ``answers`` in turn (an exception is raised)."""
    r = StepReader(None, None, Path("/nonexistent"), lambda *a: 0)  # type: ignore[arg-type]
    calls: list[int] = []

    def saved_step(step: int, **kw: Any) -> Any:
        calls.append(step)
        got = answers[min(len(calls), len(answers)) - 1]
        if isinstance(got, BaseException):
            raise got
        return got

    monkeypatch.setattr(r, "saved_step", saved_step)
    monkeypatch.setattr(step_mod, "PENDING_POLL_S", 0.001)
    return r, calls


def test_a_pending_host_not_listed_yet_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    late = StepNotFoundError("step is not committed", step=77, host=0)
    r, calls = reader([late, late, "saved"], monkeypatch)
    assert r._saved_once_listed(77, "", frozenset({0, 1}), time.perf_counter() + 60) == "saved"
    assert calls == [77, 77, 77]


def test_a_host_that_was_not_pending_is_reported_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    r, calls = reader([StepNotFoundError("step is not committed", step=77, host=2), "saved"],
                      monkeypatch)
    with pytest.raises(StepNotFoundError) as e:
        r._saved_once_listed(77, "", frozenset({0, 1}), time.perf_counter() + 60)
    assert e.value.host == 2 and calls == [77]


def test_a_pending_host_still_missing_at_the_deadline_is_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    r, calls = reader([StepNotFoundError("step is not committed", step=77, host=0)],
                      monkeypatch)
    with pytest.raises(StepNotFoundError) as e:
        r._saved_once_listed(77, "", frozenset({0}), time.perf_counter() + 0.05)
    assert e.value.host == 0 and len(calls) >= 2
