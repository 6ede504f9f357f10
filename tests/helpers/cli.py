"""The installed `fleetwise` console script (the one users run), in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None):
    """Run the fleetwise console script; returns the CompletedProcess (text). Forked from the test
    process's warm launcher pool where it has one (helpers/cli_pool.py: the script's own `main`, its
    imports done once), else a new interpreter."""
    from helpers.cli_pool import run_pooled

    exe = Path(sys.executable).parent / "fleetwise"
    full_env = {**os.environ, **(env or {})}
    pooled = run_pooled(exe, args, cwd, timeout, full_env)
    if pooled is not None:
        return pooled
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=full_env
    )


def cli_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """The console script's own `main(args)` in this test process: (exit code, stdout, stderr). No
    interpreter start and no imports again -- and a dry run's fork server (torch and the runtime
    imported once, fleetwise/dryrun/parent.py) serves every dry run of the process. For commands
    that start no job (a job's ranks belong in their own processes: run_cli)."""
    from fleetwise.cli import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err
