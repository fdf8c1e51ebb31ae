"""The Python block a page shows under a heading, as written: the tests that run the
README's and docs/'s programs read them through this one function."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def python_block(page: str, heading: str) -> str:
    """The first ```python block after ``heading`` in ``page`` (relative to the
    repository); the test fails naming both where there is none."""
    text = (REPO / page).read_text()
    assert heading in text, f"{page}: no heading {heading!r}"
    m = re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S)
    assert m, f"{page}: no python block under {heading!r}"
    return m.group(1)
