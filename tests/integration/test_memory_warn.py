"""`plan.memory_check=warn`: a job the plan says does not fit still launches and trains, after
saying so (`error`, the default, refuses it with exit 2 and starts nothing)."""

import pytest
from helpers.cli import run_cli
from helpers.runs import read_metrics

pytestmark = pytest.mark.slow

TOO_SMALL = ("recipe=gpt/tiny", "hardware.devices_per_node=1", "hardware.memory_per_device_gib=0.001")


def test_warn_launches_a_job_that_does_not_fit_and_error_refuses_it(tmp_path):
    refused = run_cli(
        "train", *TOO_SMALL, "tracking.enabled=false", f"run.dir={tmp_path / 'no'}", cwd=tmp_path
    )
    assert refused.returncode == 2 and not (tmp_path / "no").exists()
    r = run_cli(
        "train", *TOO_SMALL, "plan.memory_check=warn", "train.steps=2", "tracking.enabled=false",
        f"run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    said = " ".join(r.stdout.split())
    assert "the plan does not fit in memory (plan.memory_check=warn: launching anyway)" in said
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]
