"""One failure's timeline, from injection to the first completed step after it,
and the report entry it becomes."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from mtc.trainer.aot import READY, Use


@dataclasses.dataclass
class Recovery:
    """One failure (or scale-up) from injection to the first completed step after it."""

    kind: str
    step_at_failure: int
    t_fail: float
    detail: dict[str, Any]
    t_detect: float | None = None
    t_slices: float | None = None  # the slices to continue on are known
    t_restore_start: float | None = None
    t_restore_end: float | None = None
    resumed_from_step: int | None = None
    tier: str | None = None
    slices_after: tuple[int, ...] = ()
    # A paused failure: when the lost hosts' replacements were back (the cluster's
    # own start of a new host, simulated or not: no part of the trainer's work).
    t_replaced: float | None = None
    # A scale-up: when the step that ran on the smaller mesh as the slices came
    # back ended (training went on meanwhile; that step counts).
    t_in_flight_end: float | None = None

    def entry(self, first_step_s: float, typical_step_s: float | None,
              use: Use | None = None) -> dict[str, Any]:
        """The report's record of this recovery, now that its first step completed
        in ``first_step_s``. ``use``: how that step got its executable; its
        compile time on the recovery path (none when it was ready, but any wait
        for a build still running ahead) is the ``recompile`` stage. Without it,
        what the first step took beyond ``typical_step_s`` (the median step on
        the mesh, if known) is counted as recompilation."""
        assert self.t_detect is not None and self.t_slices is not None
        assert self.t_restore_end is not None and self.resumed_from_step is not None
        seconds = {
            "detect": self.t_detect - self.t_fail,
            "wait": self.t_slices - self.t_detect,
            "restore": self.t_restore_end - self.t_slices,
            "recompile": _recompile(first_step_s, typical_step_s, use),
            "first_step": first_step_s,
            "total": time.time() - self.t_fail,
        }
        if self.t_replaced is not None:
            # Inside ``wait``: what recovery took beyond the replacement's start.
            seconds["replacement"] = max(self.t_replaced - self.t_fail, 0.0)
            seconds["beyond_replacement"] = seconds["total"] - seconds["replacement"]
        if self.t_in_flight_end is not None:
            # Inside ``detect``: the step in flight finishing on the smaller mesh.
            seconds["in_flight_step"] = max(self.t_in_flight_end - self.t_fail, 0.0)
            seconds["beyond_in_flight_step"] = seconds["total"] - seconds["in_flight_step"]
        return {
            "kind": self.kind,
            "step_at_failure": self.step_at_failure,
            "resumed_from_step": self.resumed_from_step,
            "tier": self.tier,
            "seconds": seconds,
            "steps_lost": self.step_at_failure - self.resumed_from_step,
            "slices_after": list(self.slices_after),
            "recompile_measured_against":
                "the executable's compile time on the recovery path" if use is not None
                else "median step on this mesh" if typical_step_s is not None
                else "first step on a new mesh (no typical step yet)",
            **({"executable": use.source, "compile_s": use.compile_s,
                "executable_detail": use.as_dict()} if use is not None else {}),
            **self.detail,
        }


def _recompile(first_step_s: float, typical_step_s: float | None, use: Use | None) -> float:
    if use is not None:
        return use.waited_s if use.source == READY else use.waited_s or use.compile_s
    if typical_step_s is None:
        return first_step_s
    return max(first_step_s - typical_step_s, 0.0)
