"""scripts/gpu_check.py without a GPU: its arguments, the profile of a GPU by name, the driver's
time budget and its capture of each step's pass / fail / error / timeout into one JSON (with
stand-in steps, each in its own process as on the GPU machine), and how the steps read what they
measured."""

from __future__ import annotations

import importlib.util
import json
import sys
import time

import pytest
from helpers.repo import REPO

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses resolve their module's names
spec.loader.exec_module(gpu_check)

STAND_INS = """
import json, time
from pathlib import Path
from gpu_check import Result, Step

def env(ctx):
    return {"numbers": {"device": "stand-in"}, "checks": {"fleetwise": True}, "context": {"profile": "h200"}}

def good(ctx):
    report = json.loads((Path(ctx["out_dir"]) / "check.json").read_text())
    done = [n for n, e in report["steps"].items() if e["status"] != "pending"]
    return {"numbers": {"profile": ctx["profile"], "recorded_before_me": done, "limit_s": ctx["limit_s"]},
            "checks": {"held": True}}

def bad(ctx):
    return {"numbers": {"ratio": 3.0}, "checks": {"held": True, "near_the_plan": False}}

def boom(ctx):
    Result.progress(measured_first=1.5)
    raise ValueError("the step broke")

def hang(ctx):
    Result.progress(before_the_hang=2)
    time.sleep(120)

def never(ctx):
    raise AssertionError("a skipped step never runs")

STEPS = (
    Step("env", env, 30, 1, 30, gpu=False),
    Step("good", good, 30, 1, 30, gpu=False),
    Step("bad", bad, 30, 1, 30, gpu=False),
    Step("boom", boom, 30, 1, 30, gpu=False),
    Step("hang", hang, 3, 1, 3, gpu=False),
    Step("on_gpu", never, 30, 1, 30),
    Step("needs_x", never, 30, 1, 30, gpu=False, needs=lambda ctx: "x is not installed"),
    Step("late", never, 30, 10_000, 30, gpu=False),
)
"""


def test_arguments():
    args = gpu_check.parse(["--budget-s", "300", "--only", "bench_gpt, zero3_offload"])
    assert (args.budget_s, args.only, args.rehearse) == (300.0, {"bench_gpt", "zero3_offload"}, False)
    assert gpu_check.parse([]).budget_s == gpu_check.DEFAULT_BUDGET_S <= 450  # within 8 minutes, install too
    with pytest.raises(SystemExit) as exit_:
        gpu_check.parse(["--only", "bench_gtp"])
    assert exit_.value.code == 2
    names = [s.name for s in gpu_check.STEPS]
    assert names[0] == "env" and len(names) == len(set(names))
    needed = {
        "bench_gpt",
        "bench_resnet",
        "zero3_offload",
        "sync_count",
        "nccl_comms",
        "calibrate",
        "fp16_resume",
    }
    assert needed <= set(names)
    # the steps' least times fit the default budget, so each gets its chance
    assert sum(s.reserve_s for s in gpu_check.STEPS) < gpu_check.DEFAULT_BUDGET_S


def test_the_profile_of_a_gpu_by_its_name():
    h200 = gpu_check.choose_profile("NVIDIA H200")
    assert (h200["profile"], h200["hardware"], h200["precision"]) == ("h200", ["hardware=h200"], "bf16")
    pcie = gpu_check.choose_profile("NVIDIA H100 PCIe")
    assert pcie["profile"] == "h100" and "hardware.peak_tflops.bf16=756.5" in pcie["hardware"]
    assert gpu_check.choose_profile("Tesla V100-SXM2-32GB")["precision"] == "fp16"
    assert gpu_check.choose_profile("NVIDIA GeForce RTX 4090") is None
    # the bench case on a profile: bench_gpu's, with the part's overrides
    name, overrides = gpu_check.bench_case({**pcie, "rehearse": False}, "gpt3_1.3b")
    assert name == "gpt3_1.3b_1gpu" and "hardware.peak_tflops.bf16=756.5" in overrides
    assert "hardware.devices_per_node=1" in overrides and "train.precision=bf16" in overrides


def test_each_steps_outcome_lands_in_one_json_and_a_second_run_overwrites_it(tmp_path):
    steps_file = tmp_path / "stand_ins.py"
    steps_file.write_text(STAND_INS)
    out = tmp_path / "out" / "check.json"
    steps = gpu_check.load_steps(str(steps_file))
    for _ in range(2):  # the same OUT twice: rewritten, never refused
        started = time.monotonic()
        report = gpu_check.run_check(steps, out, tmp_path / "work", budget_s=120, steps_file=steps_file)
        assert time.monotonic() - started < 90
        assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
        s = report["steps"]
        assert {k: v["status"] for k, v in s.items()} == {
            "env": "pass", "good": "pass", "bad": "fail", "boom": "error", "hang": "timeout",
            "on_gpu": "skipped", "needs_x": "skipped", "late": "skipped",
        }  # fmt: skip
        assert s["good"]["numbers"]["profile"] == "h200"  # what env learned reaches the later steps
        assert s["good"]["numbers"]["recorded_before_me"] == ["env"]  # the JSON is written after each step
        assert s["bad"]["checks"] == {"held": True, "near_the_plan": False}
        assert s["boom"]["error"] == "ValueError: the step broke" and s["boom"]["numbers"] == {
            "measured_first": 1.5
        }
        assert "Traceback" in s["boom"]["output_tail"]
        assert s["hang"]["numbers"] == {"before_the_hang": 2} and s["hang"]["partial"] is True
        assert s["hang"]["error"] == "stopped at its limit of 3 s"
        assert s["on_gpu"]["reason"] == "no CUDA device (see env)"
        assert s["needs_x"]["reason"] == "x is not installed"
        assert s["late"]["reason"].startswith("the check's time budget is spent")
        summary = report["summary"]
        assert (summary["pass"], summary["fail"], summary["error"], summary["timeout"], summary["skipped"]) == (
            2, 1, 1, 1, 3,
        )  # fmt: skip
        assert summary["not_passed"] == ["bad", "boom", "hang"] and summary["ok"] is False
        assert sorted(p.name for p in out.parent.iterdir()) == ["check.json"]  # no temporary left


def test_a_step_gets_its_limit_less_what_the_later_steps_need(tmp_path):
    """Budget 20 s: `good` (limit 30) gets what is left less the 1 s `bad` needs at least; a step
    that could never fit the budget (`late`, 10,000 s) holds nothing back."""
    steps_file = tmp_path / "stand_ins.py"
    steps_file.write_text(STAND_INS)
    steps = gpu_check.load_steps(str(steps_file))
    report = gpu_check.run_check(
        steps,
        tmp_path / "check.json",
        tmp_path / "work",
        20,
        only={"good", "bad", "late"},
        steps_file=steps_file,
    )
    s = report["steps"]
    assert list(s) == ["env", "good", "bad", "late"]  # env always runs: it finds the profile
    assert 20 - 1 - s["env"]["seconds"] - 1 <= s["good"]["limit_s"] <= 20 - 1 - s["env"]["seconds"]
    assert s["good"]["numbers"]["limit_s"] == pytest.approx(
        s["good"]["limit_s"], abs=0.1
    )  # the step knows it
    assert s["bad"]["status"] == "fail" and s["late"]["status"] == "skipped"


def test_status_of_a_step():
    assert gpu_check.status_of(None, {"numbers": {"a": 1}}) == "timeout"
    assert gpu_check.status_of(1, {"numbers": {}}) == "error"
    assert gpu_check.status_of(0, None) == "error"
    assert gpu_check.status_of(0, {"checks": {"a": True}}) == "pass"
    assert gpu_check.status_of(0, {"checks": {"a": True, "b": False}}) == "fail"


def test_reading_a_calibration_against_the_shipped_profile():
    measured = {
        "peak_flops": {"bf16": 989.4e12, "fp32": 67e12},
        "measured_peak_flops": {"bf16": 790e12, "fp32": 52e12},
        "gemm_curve": {"1e9": 0.3, "1e12": 0.8},
        "elementwise_ns": 0.0061,
        "host_link_gbps": 48.0,
        "host_to_device_gbps": 52.0,
        "device_to_host_gbps": 44.6,
    }
    shipped = {"elementwise_ns": 0.0054, "host_link_gbps": 64, "grad_accumulate_ns": 0.0036}
    out = gpu_check.calibration_result(measured, shipped, {"bf16": 989.4e12}, "bf16")
    n = out["numbers"]
    assert n["best_gemm_over_datasheet"] == pytest.approx(790 / 989.4, abs=1e-4)
    assert n["measured_over_shipped"]["elementwise_ns"] == pytest.approx(0.0061 / 0.0054, abs=1e-4)
    assert n["measured_over_shipped"]["host_link_gbps"] == 0.75
    assert out["checks"] == {
        "profile_written": True,
        "peak_is_the_datasheets": True,
        "curve_tops_below_1": True,
    }
    # the old calibrate: peak = best GEMM, the curve topping at 1.0
    old = gpu_check.calibration_result(
        {**measured, "peak_flops": {"bf16": 790e12}, "gemm_curve": {"1e12": 1.0}},
        shipped,
        {"bf16": 989.4e12},
        "bf16",
    )
    assert old["checks"]["peak_is_the_datasheets"] is False and old["checks"]["curve_tops_below_1"] is False


def test_reading_the_resumed_run_against_the_uninterrupted_one():
    def rec(step, loss, scale=65536.0):
        return {"step": step, "train/loss": loss, "train/loss_scale": scale, "perf/step_time_s": 0.1}

    first = [rec(s, 5.0 - s / 10) for s in range(1, 7)]
    log = "... torch.compile: 4 graph(s) compiled for the blocks, 0 graph break(s)\n"
    same = gpu_check.fp16_result(
        first, [rec(s, 5.0 - s / 10 + 1e-4) for s in (4, 5, 6)], log, 30.0, 20.0, False
    )
    assert all(same["checks"].values()), same["checks"]
    assert same["numbers"]["compiled_graphs"] == 4 and same["numbers"]["b_steps"] == [4, 5, 6]
    drifted = gpu_check.fp16_result(first, [rec(s, 5.0) for s in (4, 5, 6)], "", 30.0, 20.0, False)
    assert drifted["checks"]["resumed_losses_match"] is False and drifted["checks"]["compiled"] is False
    restarted = gpu_check.fp16_result(first, [rec(s, 5.0 - s / 10) for s in (1, 2)], log, 30.0, 20.0, False)
    assert restarted["checks"]["resumed_at_step_4"] is False


def test_reading_device_memory_outside_the_allocator():
    gib = 2**30
    marks = {  # (free device memory, bytes the caching allocator reserved)
        "context": (70 * gib, 2 * 2**20),
        "world": (70 * gib - 300 * 2**20, 2 * 2**20),
        "mesh": (70 * gib - 300 * 2**20, 2 * 2**20),
        "four_more": (70 * gib - 340 * 2**20 - 20 * 2**20, 22 * 2**20),  # 20 MiB of it the allocator's
    }
    n = gpu_check.nccl_comms_result(marks, True, (2, 27, 5))["numbers"]
    assert n["world_communicator_bytes"] == 300 * 2**20 and n["mesh_bytes"] == 0
    assert (
        n["one_rank_communicators_bytes"] == 40 * 2**20 and n["per_one_rank_communicator_bytes"] == 10 * 2**20
    )
    assert n["allocator_reserved_delta_bytes"] == 20 * 2**20 and n["nccl"] == "(2, 27, 5)"
    cpu = gpu_check.nccl_comms_result({k: (None, None) for k in marks}, False, None)["numbers"]
    assert cpu["world_communicator_bytes"] is None


def test_a_bench_row_holds_the_plan_to_its_numbers():
    row = {"loss": 7.1, "predicted_over_allocated": 1.1, "step_s": 0.3, "planned_step_s": 0.25}
    assert all(gpu_check.bench_row_checks(row).values())
    far = gpu_check.bench_row_checks({**row, "predicted_over_allocated": 0.6, "loss": float("nan")})
    assert (far["plan_memory_within_25pct"], far["loss_finite"]) == (False, False)
    assert gpu_check.bench_row_checks({"error": "exit 1"}) == {"trained": False}


def test_the_json_of_a_command_among_its_warnings():
    text = (
        'W1128 warn {not json}\n{\n  "measured": {"a": 1},\n  "path": "x"\n}\nUserWarning: {"measured": 2}\n'
    )
    assert gpu_check.json_object_with(text, "measured") == {"measured": {"a": 1}, "path": "x"}
    with pytest.raises(ValueError, match="no JSON object with 'measured'"):
        gpu_check.json_object_with("nothing here", "measured")


def test_the_wheelhouse_never_carries_torch_or_what_the_image_has():
    spec = importlib.util.spec_from_file_location("gpu_wheelhouse", REPO / "scripts" / "gpu_wheelhouse.py")
    wheelhouse = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wheelhouse)
    name = "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
    assert wheelhouse.wheel_project(REPO / name) == "pydantic-core"
    for forbidden in ("torch", "nvidia-cublas", "nvidia_nccl_cu13", "triton", "numpy"):
        assert wheelhouse.NEVER.match(forbidden), forbidden
    assert not any(wheelhouse.NEVER.match(wheelhouse.canonical(n)) for n in wheelhouse.CORE)
    # MLflow's dependencies the image has (numpy, pandas, pyarrow, scipy ...) stay behind
    assert {"numpy", "pandas", "pyarrow", "scipy", "torch", "packaging"} <= wheelhouse.IMAGE
