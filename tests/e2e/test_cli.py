"""The console script as users run it: exit codes, JSON contracts, no torch on the fast path."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
from helpers.timing import LOADED_FACTOR, has_a_free_core, run_timed


def run(bin_, *args, cwd=None):
    return subprocess.run([bin_, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_validate_ok_and_json(fleetwise_bin):
    r = run(fleetwise_bin, "validate", "recipe=gpt/tiny")
    assert r.returncode == 0, r.stderr
    assert "valid" in r.stdout
    r = run(fleetwise_bin, "validate", "recipe=gpt/tiny", "--json")
    assert json.loads(r.stdout) == {"valid": True, "errors": []}


def test_validate_bad_degrees_exits_2_with_every_factor_and_no_traceback(fleetwise_bin):
    r = run(fleetwise_bin, "validate", "recipe=gpt/tiny", "strategy.dp_degree=3")
    assert r.returncode == 2
    out = r.stdout + r.stderr
    assert "Traceback" not in out
    for word in (
        "sharding_degree(1)",
        "dp_degree(3)",
        "mp_degree(1)",
        "pp_degree(1)",
        "world_size(8)",
        "fix:",
    ):
        assert word in out
    r = run(fleetwise_bin, "validate", "strategy.dp_degree=3", "train.stepz=2", "--json")
    assert r.returncode == 2
    report = json.loads(r.stdout)
    assert report["valid"] is False
    assert {e["loc"] for e in report["errors"]} == {"strategy", "train.stepz"}
    assert all(set(e) == {"loc", "msg", "hint"} for e in report["errors"])


@pytest.mark.parametrize(
    "args", [("strategy=nope",), ("train.steps=[1,",), ("recipe=gpt/none",), ("+bogus.key=1",)]
)
def test_hydra_errors_are_reported_like_config_errors(fleetwise_bin, args):
    r = run(fleetwise_bin, "validate", *args)
    assert r.returncode == 2
    assert "Traceback" not in r.stdout + r.stderr
    assert "fix:" in r.stderr


def test_plan_json_follows_the_contract(fleetwise_bin):
    r = run(
        fleetwise_bin,
        "plan",
        "recipe=gpt/gpt3_175b",
        "strategy=hybrid",
        "hardware=a100",
        "hardware.nodes=128",
        "strategy.mp_degree=8",
        "strategy.pp_degree=16",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    for key in (
        "world_size",
        "mesh",
        "params",
        "batch",
        "memory_bytes",
        "device_memory_bytes",
        "fits",
        "flops_per_step",
        "bubble_fraction",
        "step_time_s",
        "mfu",
    ):
        assert key in plan
    assert plan["world_size"] == 1024
    assert plan["mesh"] == {"pp": 16, "dp": 8, "sharding": 1, "mp": 8}
    assert all(isinstance(v, int) for v in plan["mesh"].values())
    assert set(plan["batch"]) >= {
        "global_batch_size",
        "micro_batch_size",
        "accumulate_steps",
        "num_microbatches",
    }
    assert set(plan["memory_bytes"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert plan["batch"]["accumulate_steps"] == 1536 // 8
    assert plan["fits"] is True


def test_plan_human_output_is_a_table(fleetwise_bin):
    r = run(fleetwise_bin, "plan", "recipe=gpt/gpt3_1.3b")
    assert r.returncode == 0
    for word in ("mesh", "memory/device", "step time", "MFU"):
        assert word in r.stdout


def test_plan_of_invalid_config_exits_2(fleetwise_bin):
    assert run(fleetwise_bin, "plan", "strategy.dp_degree=3").returncode == 2


def test_plan_that_does_not_fit_shows_remedies(fleetwise_bin):
    r = run(
        fleetwise_bin,
        "plan",
        "recipe=gpt/gpt3_175b",
        "strategy.pp_degree=4",
        "strategy.recompute=none",
        "--json",
    )
    plan = json.loads(r.stdout)
    assert r.returncode == 0 and plan["fits"] is False
    assert plan["remedies"] and any(x["fits"] for x in plan["remedies"])
    r = run(
        fleetwise_bin, "validate", "recipe=gpt/gpt3_175b", "strategy.pp_degree=4", "strategy.recompute=none"
    )
    assert r.returncode == 2 and "remedies" in r.stderr


def test_help_lists_groups_and_cfg_job_prints_config(fleetwise_bin):
    r = run(fleetwise_bin, "--help")
    assert r.returncode == 0
    for group in ("strategy", "hardware", "recipe", "model", "data", "optim"):
        assert group in r.stdout
    assert "gpt/gpt3_175b" in r.stdout
    r = run(fleetwise_bin, "plan", "strategy=hybrid", "strategy.pp_degree=2", "--cfg", "job")
    assert r.returncode == 0
    assert "pp_degree: 2" in r.stdout and "name: hybrid" in r.stdout


def test_unknown_command_exits_2(fleetwise_bin):
    r = run(fleetwise_bin, "plna")
    assert r.returncode == 2 and "plan" in r.stderr


def test_validate_and_plan_do_not_import_torch():
    code = (
        "import sys\n"
        "from fleetwise.cli import main\n"
        "assert main(['validate', 'recipe=gpt/gpt3_1.3b']) == 0\n"
        "assert main(['plan', 'recipe=gpt/gpt3_175b', '--json']) == 0\n"
        "assert main(['validate', 'strategy.dp_degree=3']) == 2\n"
        "heavy = sorted(m for m in ('torch', 'mlflow') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


HEAVY_IMPORTS = re.compile(r"\|\s+(torch|mlflow)$", re.M)  # PYTHONPROFILEIMPORTTIME's top-level lines


# README: `plan` "answers in about a second" (measured at idle on the 2-core VM: 1.0 s with Python's
# bytecode cache, 1.2-1.8 s without it -- PYTHONDONTWRITEBYTECODE there): held at 2 s ("about": up to
# twice), under the one load allowance of helpers/timing.py (busy: 4 s of CPU time). Importing torch
# on the way costs ~3.4 CPU-s more here; the import check above names it first.
PLAN_S = 2.0


def test_plan_starts_fast(fleetwise_bin):
    """`plan` answers in about a second (README) because it never imports torch or mlflow
    (~2-3 s each): asserted on the imports themselves, which load on the machine cannot change,
    and on its time: the best of 3 within PLAN_S (wall and CPU time at idle, CPU time x the load
    allowance when busy)."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    r = subprocess.run(
        [fleetwise_bin, "plan", "recipe=gpt/gpt3_1.3b"], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert not HEAVY_IMPORTS.findall(r.stderr), HEAVY_IMPORTS.findall(r.stderr)
    tries = [run_timed([fleetwise_bin, "plan", "recipe=gpt/gpt3_1.3b"], timeout=120) for _ in range(3)]
    assert all(r.returncode == 0 for r, _ in tries)
    best = min((t for _, t in tries), key=lambda t: t.cpu)
    print(f"plan answered in {best} (best of 3)")
    assert best.within(PLAN_S), f"{best}: over {PLAN_S} s ({LOADED_FACTOR}x on CPU time when busy)"


def test_calibrate_writes_a_profile_the_planner_uses(fleetwise_bin, tmp_path):
    """`fleetwise calibrate` measures this machine (no comm: the 2-process part is the bench's) and
    writes a profile that `hardware=local` selects from any directory. With --quick: every probe
    runs, each with a fifth of its repetitions (the full count only adds samples to the same
    medians; test_profile.py holds the share)."""
    import yaml

    env = {**os.environ, "FLEETWISE_CONFIG_DIR": str(tmp_path)}
    keys = (
        "op_overhead_us",
        "elementwise_ns",
        "update_us_per_tensor",
        "conv_call_us",
        "selective_checkpoint_op_us",
    )

    def calibrate():
        r = subprocess.run(
            [fleetwise_bin, "calibrate", "--no-comm", "--quick", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["measured"], yaml.safe_load(
            (tmp_path / "hardware" / "local.yaml").read_text()
        )

    # One run; every check below counts. Several host costs are differences of two timings, and
    # with no core free the difference drowns: measured here at load 5.7 on 2 cores (with and
    # without `nice -15`), op overhead 4.2 ms (not µs), a flat GEMM curve of 1.0, three host costs
    # 0 -- calibrate itself is then wrong, and a retry until it happens to look right proved
    # nothing. So the values' quality is held where the machine had a core free (load average
    # below its cores, before and after), on that one run; what holds at any load always.
    free = has_a_free_core()
    measured, profile = calibrate()
    free = free and has_a_free_core()
    curve = profile["gemm_efficiency"]
    print(f"a core free throughout: {free}; " + ", ".join(f"{k} {profile[k]}" for k in keys))
    assert measured["peak_flops"]["fp32"] > 1e9
    for key in keys:  # the host costs the planner's time model charges, each written as a number
        assert math.isfinite(profile[key]) and profile[key] >= 0, key
    assert all(0 < e <= 1.0 for _, e in curve), curve
    if free:
        for key in keys:
            assert profile[key] > 0, key  # measured on this machine
        assert curve[0][1] < curve[-1][1]  # small GEMMs run further below peak than large ones
    r = subprocess.run(
        [fleetwise_bin, "plan", "recipe=gpt/tiny", "hardware=local", "--json"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["time_s"]["update"] > 0 and (plan["time_s"]["elementwise"] > 0 or not free)
