"""JSON-lines logs of training processes: one ``write`` per line, so a written
line survives a SIGKILL of the process."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, TextIO


class JsonLog:
    """Appends JSON lines, one ``write`` per line (a written line survives a SIGKILL)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f: TextIO = path.open("a", buffering=1)
        self._lock = threading.Lock()

    def write(self, **fields: Any) -> None:
        fields.setdefault("t", time.time())
        with self._lock:
            self._f.write(json.dumps(fields) + "\n")

    def close(self) -> None:
        self._f.close()


class JsonTail:
    """Reads a JSON-lines log as it grows; a half-written last line waits."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._offset = 0

    def poll(self) -> list[dict[str, Any]]:
        """The new complete lines since the last call."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        new = [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]
        self.records.extend(new)
        return new
