"""The job file's knobs of the replicators and the trainer (``replicator`` and
``trainer`` in deploy/job.example.yaml): read and checked (:func:`read`), then
set on the rendered containers (:func:`apply`). Defaults are the base's own
arguments, so a job file without these keys renders as before."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

REPLICATOR_KEYS = {"keep", "replicas", "backupIntervalMinutes", "backupIntervalSteps",
                   "backupKeep"}
TRAINER_KEYS = {"image", "command", "args"}
# An image reference: registry/path, then :tag and/or @sha256:digest; no spaces.
IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*(@sha256:[0-9a-f]{64})?$")


class KnobError(ValueError):
    """A knob this job file gets wrong: the key and why (configure.py adds the file)."""


@dataclasses.dataclass(frozen=True)
class Knobs:
    keep: int = 1                        # --keep: own steps each replicator keeps
    replicas: int = 1                    # --replicas: peer copies of each step
    backup_minutes: float = 30.0         # --backup-interval-minutes (0: none by time)
    backup_steps: int | None = None      # --backup-interval-steps
    backup_keep: int = 3                 # --backup-keep: newest backups kept
    image: str | None = None             # the trainer's image (None: mtc's demo trainer)
    command: tuple[str, ...] | None = None
    args: tuple[str, ...] | None = None  # None: the demo trainer's arguments


def _int(key: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise KnobError(f"{key}: {value!r} is not an integer >= {least}")
    return value


def _words(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
        raise KnobError(f"{key}: not a list of strings")
    return tuple(value)


def read(data: dict[str, Any]) -> Knobs:
    """The knobs of a job file's mapping ``data`` (its other keys are configure.py's)."""
    # A key with only comments under it (the example's trainer) is YAML's null.
    rep = {} if data.get("replicator") is None else data["replicator"]
    trainer = {} if data.get("trainer") is None else data["trainer"]
    for key, value, known in (("replicator", rep, REPLICATOR_KEYS),
                              ("trainer", trainer, TRAINER_KEYS)):
        if not isinstance(value, dict):
            raise KnobError(f"{key}: not a mapping")
        for k in value:
            if k not in known:
                raise KnobError(f"{key}.{k}: unknown key (known: {', '.join(sorted(known))})")
    minutes = rep.get("backupIntervalMinutes", 30)
    if isinstance(minutes, bool) or not isinstance(minutes, int | float) or minutes < 0:
        raise KnobError(f"replicator.backupIntervalMinutes: {minutes!r} is not a number >= 0")
    steps = rep.get("backupIntervalSteps")
    if steps is not None:
        steps = _int("replicator.backupIntervalSteps", steps, 1)
        if "backupIntervalMinutes" in rep:
            raise KnobError("replicator: backupIntervalMinutes and backupIntervalSteps "
                            "exclude each other")
        minutes = 0
    image = trainer.get("image")
    if image is not None and (not isinstance(image, str) or not IMAGE.match(image)):
        raise KnobError(f"trainer.image: {image!r} is not an image reference")
    return Knobs(
        keep=_int("replicator.keep", rep.get("keep", 1), 1),
        replicas=_int("replicator.replicas", rep.get("replicas", 1), 0),
        backup_minutes=float(minutes), backup_steps=steps,
        backup_keep=_int("replicator.backupKeep", rep.get("backupKeep", 3), 1),
        image=image,
        command=_words("trainer.command", trainer["command"]) if "command" in trainer else None,
        args=_words("trainer.args", trainer["args"]) if "args" in trainer else None)


def _set(c: dict[str, Any], flag: str, value: object | None) -> None:
    """``flag=value`` in place of the container's ``flag=...`` (appended when absent);
    ``None`` removes it."""
    args = list(c.get("args", []))
    at = next((i for i, a in enumerate(args) if a.startswith(flag + "=")), None)
    if at is not None:
        del args[at]
    if value is not None:
        args.insert(len(args) if at is None else at, f"{flag}={value}")
    c["args"] = args


def apply(name: str, c: dict[str, Any], knobs: Knobs) -> None:
    """Set the knobs on the rendered container ``c`` named ``name``."""
    if name == "replicator":
        _set(c, "--keep", knobs.keep)
        _set(c, "--replicas", knobs.replicas)
        minutes = knobs.backup_minutes
        _set(c, "--backup-interval-minutes",
             None if not minutes else int(minutes) if minutes == int(minutes) else minutes)
        _set(c, "--backup-interval-steps", knobs.backup_steps)
        _set(c, "--backup-keep", knobs.backup_keep)
    elif name == "trainer":
        if knobs.image is not None:
            c["image"] = knobs.image
        if knobs.command is not None:
            c["command"] = list(knobs.command)
        if knobs.args is not None:
            c["args"] = list(knobs.args)
