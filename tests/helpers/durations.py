"""tests/DURATIONS.md read back: the order test files run in (conftest.py)."""

from __future__ import annotations

import re
from pathlib import Path


def file_seconds(table: Path) -> dict[str, float]:
    """Seconds per test file from tests/DURATIONS.md's table (scripts/durations.py writes it)."""
    if not table.exists():
        return {}
    rows = re.findall(r"^\| (tests/\S+\.py) \| \d+ \| ([\d,.]+) \|", table.read_text(), flags=re.MULTILINE)
    return {path: float(sec.replace(",", "")) for path, sec in rows}
