"""Orbax's step statistics: what a save or a restore did, given to the manager's logger.

After each ``save`` that writes and each ``restore``, Orbax's ``CheckpointManager``
hands its logger (``logger=``, an ``AbstractLogger``: anything with
``log_entry(dict)``; by default its ``StandardLogger``, an INFO line) a dict with the
fields of its ``SaveStepStatistics`` or ``RestoreStepStatistics``. mtc hands the same
dicts, with the same field names and wall-clock times (``time.time()``), so that a
user's logger (Orbax's ``CloudLogger``, ``CompositeLogger``, their own) and whatever
reads Orbax's INFO lines keep working. The phases are mtc's (see
:func:`save_entry`); Orbax is not imported.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from mtc.errors import ConfigError

# The manager's logger name: the one users configure for every mtc.manager line.
log = logging.getLogger("mtc.manager")


class StepLogger(Protocol):
    """Orbax's ``AbstractLogger``: what ``CheckpointManager(logger=)`` takes."""

    def log_entry(self, entry: dict[str, Any]) -> None: ...


class StandardLogger:
    """The default, as Orbax's ``StandardLogger``: one INFO line per save and restore
    whose text from its first ``{`` is the dict (``ast.literal_eval`` reads it back)."""

    def log_entry(self, entry: dict[str, Any]) -> None:
        log.info("mtc: %s step statistics %r", entry.get("event_type", "step"), entry)


class Quiet:
    """A logger that keeps nothing: that of the read-only manager a restore from
    another directory reads through (the calling manager gives the statistics)."""

    def log_entry(self, entry: dict[str, Any]) -> None:
        pass


def check_logger(logger: Any) -> StepLogger:
    """``logger`` as given (``None``: :class:`StandardLogger`), or a ConfigError."""
    if logger is None:
        return StandardLogger()
    if not callable(getattr(logger, "log_entry", None)):
        raise ConfigError(f"logger must have log_entry(dict) (Orbax's AbstractLogger), got "
                          f"{type(logger).__name__}")
    return logger


def save_entry(*, step: int, directory: str, began: float, ended: float,
               checked: tuple[float, float], staged: tuple[float, float],
               retention: tuple[float, float] | None, synchronous: bool,
               preempted_at: float | None, previous_began: float | None) -> dict[str, Any]:
    """Orbax's ``SaveStepStatistics`` of one mtc save (times: ``time.time()``; each
    phase a (start, seconds) pair).

    - ``checkpoint_manager_blocking_*``: the whole ``save`` call;
    - ``wait_for_prev_*``: the check of earlier saves (their errors raised here).
      mtc never waits for an earlier save to commit before staging the next one:
      a full staging budget (``Options.max_staged_bytes``) is waited for inside
      staging, in ``checkpointer_blocking_*``;
    - ``checkpointer_blocking_*``: staging the state to host memory and handing it
      to the hosts' writers;
    - ``get_old_steps_*``: retention on the RAM disks before this step is written
      (Orbax's comes after the write); ``None`` where the save applied none;
    - ``reached_preemption``: the save was due to JAX's preemption sync point.
    """
    return {
        "step": step, "event_type": "save", "directory": directory,
        "reached_preemption": preempted_at is not None,
        "preemption_received_at": preempted_at,
        "synchronous": synchronous,
        "wait_for_prev_start_time": checked[0], "wait_for_prev_duration_secs": checked[1],
        "time_between_consecutive_saves_sec": (None if previous_began is None
                                               else began - previous_began),
        "checkpointer_blocking_start_time": staged[0],
        "checkpointer_blocking_duration_secs": staged[1],
        "get_old_steps_start_time": retention[0] if retention else None,
        "get_old_steps_duration_secs": retention[1] if retention else None,
        "checkpoint_manager_blocking_start_time": began,
        "checkpoint_manager_blocking_duration_secs": ended - began,
    }


def restore_entry(*, step: int | None, directory: str, began: float, ended: float,
                  load_seconds: float | None) -> dict[str, Any]:
    """Orbax's ``RestoreStepStatistics`` of one mtc restore: the whole call
    (``checkpoint_manager_*``) and its load of the shards into the target
    (``checkpointer_*``), after the step was agreed and the hosts' data made local."""
    load = load_seconds if load_seconds is not None else ended - began
    return {
        "step": step, "event_type": "restore", "directory": directory,
        "checkpointer_start_time": ended - load, "checkpointer_duration_secs": load,
        "checkpoint_manager_start_time": began,
        "checkpoint_manager_duration_secs": ended - began,
    }


def hand(logger: StepLogger, entry: dict[str, Any]) -> None:
    """Give ``entry`` to ``logger``; a logger that fails is logged, never raised: the
    save or restore it describes succeeded, and the loop must not think otherwise."""
    try:
        logger.log_entry(entry)
    except Exception as e:  # noqa: BLE001 - a user's logger: anything
        log.warning("mtc: the CheckpointManager's logger failed on the %s statistics of "
                    "step %s: %s: %s", entry.get("event_type"), entry.get("step"),
                    type(e).__name__, e)
