"""Training processes the crash demo (:mod:`mtc.trainer.demo`) supervises: each
launched as ``python -m mtc.trainer.train``, followed through its JSON log with
one live status line, and SIGKILLed at a step when asked (a real crash)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mtc.trainer.jsonlog import JsonTail

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.02


# What a training process is doing before its first step, by its last logged event.
PHASES: dict[str | None, str] = {
    None: "starting Python, importing JAX",
    "start": "building the mesh and the checkpoint manager",
    "ready": "initialising or restoring the state",
    "init": "compiling the train step",
    "restore": "compiling the train step",
}


class ChildFailed(RuntimeError):
    pass


@dataclasses.dataclass
class Child:
    """A training process and what it has logged so far."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    out_path: Path
    t_launch: float
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    _tail: JsonTail | None = None

    def poll_log(self) -> list[dict[str, Any]]:
        """New complete lines of the JSON log (a half-written last line waits)."""
        if self._tail is None:
            self._tail = JsonTail(self.log_path)
        new = self._tail.poll()
        self.records.extend(new)
        return new

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "loss" in r]

    def event(self, name: str) -> dict[str, Any] | None:
        return next((r for r in self.records if r.get("event") == name), None)

    def output_tail(self, lines: int = 25) -> str:
        try:
            text = self.out_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Progress:
    """One live status line on a terminal; occasional plain lines otherwise."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.tty = sys.stdout.isatty()
        self._last_plain = -1
        self._width = 0
        self._text = ""

    def update(self, child: Child) -> None:
        steps = child.steps
        if not steps:
            events = [r["event"] for r in child.records if "event" in r]
            phase = PHASES.get(events[-1] if events else None, "running")
            text = f"  [{child.name:9}] {phase} ({time.time() - child.t_launch:4.1f}s)"
            step = -1
        else:
            last = steps[-1]
            step = last["step"]
            recent = [s["step_s"] for s in steps[1:][-10:]] or [last["step_s"]]  # not compiling
            rate = len(recent) / max(sum(recent), 1e-9)
            saved = [s["step"] for s in steps if s.get("saved")]
            text = (f"  [{child.name:9}] step {step:4d}/{self.total}  loss {last['loss']:.4f}"
                    f"  {rate:5.1f} steps/s" + (f"  last save {saved[-1]}" if saved else ""))
        if self.tty:
            if text == self._text:
                return
            self._text = text
            pad = max(self._width - len(text), 0)
            sys.stdout.write("\r" + text + " " * pad)
            sys.stdout.flush()
            self._width = len(text)
        elif step >= 0 and step // 25 != self._last_plain // 25:
            print(text, flush=True)
            self._last_plain = step

    def say(self, text: str) -> None:
        if self.tty and self._width:
            sys.stdout.write("\r" + " " * self._width + "\r")
            self._width = 0
            self._text = ""
        print(text, flush=True)


def launch(name: str, out: Path, args: list[str], env: dict[str, str]) -> Child:
    log_path, out_path = out / f"{name}.jsonl", out / f"{name}.log"
    log_path.unlink(missing_ok=True)
    with out_path.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "mtc.trainer.train", "--log", str(log_path),
                                 *args], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return Child(name, proc, log_path, out_path, time.time())


@dataclasses.dataclass
class Kill:
    t_kill: float
    t_detected: float
    step_seen: int


def supervise(child: Child, progress: Progress, kill_at: int | None = None) -> Kill | None:
    """Follow ``child`` to its exit; SIGKILL it once it logs step ``kill_at``."""
    t_kill: float | None = None
    step_seen = -1
    while True:
        child.poll_log()
        progress.update(child)
        if kill_at is not None and t_kill is None and child.steps \
                and child.steps[-1]["step"] >= kill_at:
            step_seen = child.steps[-1]["step"]
            t_kill = time.time()
            os.kill(child.proc.pid, signal.SIGKILL)
        rc = child.proc.poll()
        if rc is not None:
            t_exit_seen = time.time()
            child.poll_log()
            progress.update(child)
            break
        time.sleep(POLL_S)
    if t_kill is not None:
        if rc != -signal.SIGKILL:
            raise ChildFailed(f"{child.name}: expected death by SIGKILL, exit status {rc}")
        return Kill(t_kill, t_exit_seen, step_seen)
    if rc != 0:
        raise ChildFailed(f"{child.name} exited with status {rc}; its output ends:\n"
                          f"{child.output_tail()}")
    if kill_at is not None:
        raise ChildFailed(f"{child.name} finished before reaching step {kill_at}")
    return None
