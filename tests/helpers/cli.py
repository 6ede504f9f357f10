"""The installed `fleetwise` console script (the one users run), in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None):
    """Run the fleetwise console script; returns the CompletedProcess (text)."""
    exe = Path(sys.executable).parent / "fleetwise"
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=full_env
    )
