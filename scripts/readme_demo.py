#!/usr/bin/env python3
"""Run the demo job and paste its output into README.md (the block after "The demo trains").

    make readme-demo                                   # the Makefile's DEMO overrides
    .venv/bin/python scripts/readme_demo.py OVERRIDES… # the same, by hand

Runs `fleetwise train OVERRIDES…` in a temporary directory (its own MLflow store and outputs, so
nothing is left behind), keeps the console from the summary to the MLflow run line, and rewrites
the fenced block between the markers `<!-- demo-output:begin -->` and `<!-- demo-output:end -->`,
with the date and machine in the line before it. Exits 1 (README untouched) if the job fails.
"""

from __future__ import annotations

import os
import platform as host
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- demo-output:begin -->", "<!-- demo-output:end -->"
STAMP = re.compile(r"\(`make demo` on [^)]*\):")


def demo_output(overrides: list[str]) -> str:
    exe = Path(sys.executable).parent / "fleetwise"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["COLUMNS"] = "100"
    with tempfile.TemporaryDirectory(prefix="fleetwise-demo-") as tmp:
        r = subprocess.run(
            [str(exe), "train", *overrides],
            cwd=tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # one stream, in the order a terminal shows it
            text=True,
        )
    lines = r.stdout.splitlines()
    if r.returncode != 0:
        sys.stderr.write(
            "\n".join(lines[-40:]) + f"\nthe demo failed (exit {r.returncode}); README.md unchanged\n"
        )
        raise SystemExit(1)
    start = next(i for i, line in enumerate(lines) if line.startswith("summary ("))
    end = next(i for i, line in enumerate(lines) if line.startswith("MLflow run "))
    kept = [line.rstrip() for line in lines[start : end + 1]]
    # the run ids are this run's own: shorten them as a reader would see them
    kept = [re.sub(r"MLflow run ([0-9a-f]{8})[0-9a-f]+", r"MLflow run \1…", line) for line in kept]
    kept = [line for line in kept if not line.startswith(("20", "["))]  # stray rank log lines, if any
    return "\n".join(kept)


def rewrite(readme: str, output: str, stamp: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"README.md has no {BEGIN} … {END} block")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    before, sep, last = head.rpartition("(`make demo` on ")
    if sep:
        head = before + STAMP.sub(stamp, sep + last, count=1)
    return f"{head}{BEGIN}\n```\n{output}\n```\n{END}{tail}"


def main(argv: list[str]) -> int:
    overrides = argv or ["recipe=gpt/tiny"]
    load = os.getloadavg()[0]  # other jobs on the machine slow the demo: say how busy it was
    output = demo_output(overrides)
    load = max(load, os.getloadavg()[0])
    cores = os.cpu_count() or 1
    stamp = (
        f"(`make demo` on a {cores}-core {host.machine()} machine, load average {load:.1f}, "
        f"{time.strftime('%Y-%m-%d')}):"
    )
    path = REPO / "README.md"
    path.write_text(rewrite(path.read_text(), output, stamp))
    print(output)
    print(f"README.md updated {stamp}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
