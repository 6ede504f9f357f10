"""scripts/bench_gpu.py without a GPU: it skips cleanly, and what it would run and report is right."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers.config import compose
from helpers.repo import REPO

spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "scripts" / "bench_gpu.py")
bench_gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_gpu)


def test_skips_without_cuda(tmp_path):
    out = tmp_path / "gpu.json"
    assert bench_gpu.main([str(out)]) == 0
    assert json.loads(out.read_text()) == {"skipped": "no CUDA device"}


def test_profiles_and_precision():
    assert bench_gpu.profile_for("NVIDIA H100 80GB HBM3") == "h100"
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
