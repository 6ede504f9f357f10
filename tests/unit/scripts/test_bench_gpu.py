"""scripts/bench_gpu.py without a GPU: it skips cleanly, and what it would run and report is right."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
from helpers.config import compose
from helpers.repo import REPO

spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "scripts" / "bench_gpu.py")
bench_gpu = importlib.util.module_from_spec(spec)
sys.modules["bench_gpu"] = bench_gpu  # its dataclass resolves its module's names
spec.loader.exec_module(bench_gpu)


def test_skips_without_cuda(tmp_path):
    out = tmp_path / "gpu.json"
    assert bench_gpu.main([str(out)]) == 0
    assert json.loads(out.read_text()) == {"skipped": "no CUDA device"}


def test_profiles_and_precision():
    assert bench_gpu.profile_for("NVIDIA H100 80GB HBM3") == "h100"
    assert bench_gpu.profile_for("NVIDIA H200") == "h200"
    assert bench_gpu.profile_for("NVIDIA A100-SXM4-40GB") == "a100"
    assert bench_gpu.profile_for("Tesla V100-SXM2-32GB") == "v100"
    assert bench_gpu.profile_for("NVIDIA GeForce RTX 4090") is None
    assert (bench_gpu.precision_for("h100"), bench_gpu.precision_for("v100")) == ("bf16", "fp16")


@pytest.mark.parametrize("profile", ["h100", "v100"])
def test_every_run_is_a_valid_config(profile):
    runs = bench_gpu.cases(profile, 8, 12)
    assert [n for n, _ in runs] == ["gpt3_1.3b_1gpu", "gpt3_1.3b_8gpu", "resnet50_1gpu", "resnet50_8gpu"]
    for name, overrides in runs:
        cfg, problems = compose(*overrides)
        assert cfg is not None, (name, problems)
        assert cfg.hardware.world_size == (8 if name.endswith("8gpu") else 1)
        assert cfg.train.precision == bench_gpu.precision_for(profile)
    assert len(bench_gpu.cases("h100", 1, 12)) == 2  # a one-GPU node runs each model once


def test_summary_of_a_run():
    def rec(step, t, mem, reserved):
        return {"step": step, "perf/step_time_s": t, "perf/mfu": 0.4 / t, "perf/samples_per_s": 8 / t,
                "perf/tokens_per_s": 8 * 2048 / t, "memory/peak_bytes_max": mem, "memory/reserved_bytes_max": reserved}  # fmt: skip

    records = [rec(1, 9.0, 50.0, 60.0), *(rec(s, 1.0 + s / 100, 40.0, 70.0) for s in range(2, 9))]
    plan = {"memory_bytes": {"total": 45.0}, "device_memory_bytes": 100.0, "usable_memory_bytes": 90.0,
            "step_time_s": 0.9, "mfu": 0.5, "fits": True}  # fmt: skip
    row = bench_gpu.summarize(records, plan)
    assert row["first_step_s"] == 9.0
    assert row["step_s"] == pytest.approx(1.06)  # median of steps 4..8, after the warm-up
    assert row["tokens_per_s"] == pytest.approx(8 * 2048 / 1.06)
    assert (row["allocated_bytes"], row["reserved_bytes"]) == (50.0, 70.0)
    assert row["predicted_over_allocated"] == pytest.approx(0.9)
    assert row["reserved_over_usable"] == pytest.approx(70 / 90)


def test_each_gpu_part_is_planned_with_its_own_datasheet():
    """H100 PCIe and NVL are not the SXM board the h100 profile describes (989 TF/s): planned as
    it, MFU read 1.3x high; an H200 was skipped. Each part's overrides compose into a config whose
    peak and memory are its datasheet's."""
    pcie = bench_gpu.hardware_for("NVIDIA H100 PCIe")
    assert (pcie.profile, bench_gpu.profile_for("NVIDIA H100 NVL")) == ("h100", "h100")
    assert bench_gpu.profile_for("NVIDIA H200") == bench_gpu.profile_for("NVIDIA H200 NVL") == "h200"
    assert bench_gpu.profile_for("NVIDIA GH200 480GB") is None  # Grace Hopper: its own memory
    expected = {  # bf16 dense TFLOP/s, GiB
        "NVIDIA H100 80GB HBM3": (989.4, 80),
        "NVIDIA H100 PCIe": (756.5, 80),
        "NVIDIA H100 NVL": (835.5, 94),
        "NVIDIA H200": (989.4, 141),
        "NVIDIA A100-SXM4-40GB": (312, 40),
    }
    for name, (bf16, gib) in expected.items():
        gpu = bench_gpu.hardware_for(name)
        (_, overrides), *_ = bench_gpu.cases(gpu.profile, 1, 6, gpu.overrides())
        cfg, problems = compose(*overrides)
        assert cfg is not None, (name, problems)
        hw = cfg.hardware
        assert (hw.name, hw.peak_tflops.bf16, hw.memory_per_device_gib) == (gpu.profile, bf16, gib), name


def _fake_train(tmp_path, body: str) -> list[str]:
    """A stand-in for `fleetwise train`: refuses a run.dir that holds files (as fleetwise does
    without run.overwrite), then runs `body` with `run_dir` set."""
    script = tmp_path / "fake_train.py"
    script.write_text(
        "import json, os, sys, time\n"
        "from pathlib import Path\n"
        "run_dir = Path(next(a for a in sys.argv if a.startswith('run.dir=')).split('=', 1)[1])\n"
        "if run_dir.exists() and any(run_dir.iterdir()):\n"
        "    print(f'{run_dir} is not empty'); sys.exit(2)\n"
        "run_dir.mkdir(parents=True, exist_ok=True)\n" + body
    )
    return [sys.executable, str(script)]


WRITES_A_RUN = (
    "rec = {'step': 1, 'perf/step_time_s': 0.5, 'perf/mfu': 0.4, 'perf/samples_per_s': 8.0,\n"
    "       'memory/peak_bytes_max': 40.0}\n"
    "(run_dir / 'metrics.jsonl').write_text(json.dumps(rec) + '\\n')\n"
    "(run_dir / 'plan.json').write_text(json.dumps({'memory_bytes': {'total': 45.0},\n"
    "    'device_memory_bytes': 100.0, 'step_time_s': 0.4, 'mfu': 0.5, 'fits': True}))\n"
)


def test_a_second_run_into_the_same_out_measures_again(tmp_path):
    """The runs' folder is cleared first: a second bench into the same OUT used to meet every
    run.dir of the first and fail each run."""
    train = _fake_train(tmp_path, WRITES_A_RUN)
    out = tmp_path / "gpu.json"
    for _ in range(2):
        rows = bench_gpu.bench(out, "h100", 1, 6, timeout_s=60, train=train)
        assert [r["name"] for r in rows] == ["gpt3_1.3b_1gpu", "resnet50_1gpu"]
        assert [r.get("error") for r in rows] == [None, None], rows
        assert rows[0]["step_s"] == 0.5 and rows[0]["predicted_over_allocated"] == pytest.approx(45 / 40)
    bench_gpu.write(out, {"rows": rows})
    bench_gpu.write(out, {"rows": []})  # OUT rewritten whole
    assert json.loads(out.read_text()) == {"rows": []}


def test_a_run_past_its_time_limit_is_stopped_with_its_children(tmp_path):
    """A hung `fleetwise train` (torchrun and its ranks) is stopped at the limit, every process of
    it, and the row says so; the bench goes on with the next run."""
    hang = (
        "import subprocess\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "(run_dir.parent / f'{run_dir.name}.child').write_text(str(child.pid))\n"
        "print('hanging', flush=True); time.sleep(120)\n"
    )
    train = _fake_train(tmp_path, hang)
    started = time.monotonic()
    row = bench_gpu.run("hung", ["recipe=gpt/tiny"], tmp_path, timeout_s=3, train=train)
    assert time.monotonic() - started < 30
    assert row["error"] == "timed out after 3 s" and "hanging" in row["output_tail"]
    child = int((tmp_path / "hung.child").read_text())
    for _ in range(50):  # the kill is delivered asynchronously
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")  # a zombie is dead


def test_fleetwise_runs_as_a_module_of_this_interpreter():
    """No console script on the PATH is needed (a wheel installed with --target has none there)."""
    assert bench_gpu.TRAIN[:3] == [sys.executable, "-m", "fleetwise"]
    r = bench_gpu.run_bounded(
        [*bench_gpu.TRAIN[:3], "--help"], 60, env={**os.environ, "PATH": "/nonexistent"}
    )
    assert r.returncode == 0 and "calibrate" in r.output, r.output
