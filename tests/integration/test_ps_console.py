"""A parameter-server job's console: one throughput figure, no torch deprecation noise."""

import re

from helpers.cli import run_cli


def test_a_ps_job_prints_one_throughput_and_no_warning(tmp_path):
    r = run_cli(
        "train",
        "recipe=ctr/tiny",
        "strategy=ps",
        "train.steps=4",
        "tracking.enabled=false",
        f"run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "Warning" not in out, out
    step_line = re.compile(r"\[trainer\d+\] step \d+/\d+:")  # each step's own rate, like collective jobs
    rates = [line for line in out.splitlines() if "samples/s" in line and not step_line.search(line)]
    assert len(rates) == 1 and rates[0].lstrip().startswith("throughput"), rates
