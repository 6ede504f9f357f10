#!/usr/bin/env python3
"""The GPU check (#39): what only a GPU can show of fleetwise, in one call on a bare GPU machine,
into ONE JSON -- every number, and each step's pass / fail / error / timeout / skipped.

    bash scripts/gpu_check.sh        on the GPU machine: installs the wheelhouse (.whl/), runs this
    python scripts/gpu_check.py [--out FILE] [--budget-s S] [--only STEP,...] [--rehearse]

This workplace's device tool runs it thus (build the wheels first, here: `make gpu-wheelhouse`):

    run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)

Steps, in order (each in a process of its own under its own time limit, so that a crash, a hang or
an out-of-memory loses that step only; the JSON is rewritten after every step):

    env             torch, CUDA, the GPU, the packages; the hardware profile of the part (H200 too)
    bench_gpt       GPT-3 1.3B, bf16, 1 GPU (`fleetwise train`): step time, MFU, memory vs its plan
    bench_resnet    ResNet-50, the same
    zero3_offload   rank 0 of an 8-GPU ZeRO-3 + offload GPT-3 1.3B job on the real GPU, the other 7
                    ranks faked (torch's fake process group: collectives move nothing; here every
                    peer mirrors rank 0, so the tensors hold real values): memory and step time vs
                    the plan's rank 0
    sync_count      host-device synchronizations of each training step under
                    torch.cuda.set_sync_debug_mode (a step between two logging steps should have none)
    nccl_comms      torch.cuda.mem_get_info around NCCL process groups on 1 GPU: the device memory a
                    communicator takes outside PyTorch's allocator (what it cannot measure: see there)
    calibrate       `fleetwise calibrate --no-comm`: the part's measured GEMMs, curve, host link, per-
                    element costs against its shipped profile
    fp16_resume     a small GPT in fp16 with torch.compile, checkpointed, resumed from the middle:
                    the resumed steps against the uninterrupted ones
    tracking        one tracked run (MLflow, system metrics with the GPU's), when .whl/mlflow came along

--budget-s bounds the whole check: a step starts only with its least useful time left for it and
for every step after it, and is stopped at its own limit. --rehearse runs the same steps on this
machine's CPU with tiny models (no GPU needed: the driver, the steps' code and the JSON); the
calibrate step is not rehearsed there (on a CPU it measures host costs for minutes).

The driver needs only the standard library (fleetwise is imported by the steps): a failed install
still gets its JSON, every step saying what went wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import re
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
SCHEMA = 1
DEFAULT_BUDGET_S = 420.0
STATUSES = ("pass", "fail", "error", "timeout", "skipped")
TAIL = 3000  # characters of a step's output kept in the JSON


@dataclass(frozen=True)
class Step:
    """One step of the check: `fn(ctx)` runs in a process of its own and returns
    {"numbers": {...}, "checks": {name: bool}, "notes": [...], "context": {...}} ("context": what
    later steps learn from it)."""

    name: str
    fn: Callable[[dict], dict]
    limit_s: float  # on a GPU
    reserve_s: float  # the least time worth starting it with
    rehearse_limit_s: float  # on this machine's CPU, tiny models
    gpu: bool = True  # needs a CUDA device (and a known profile) unless rehearsing
    what: str = ""
    needs: Callable[[dict], str | None] | None = None  # why it cannot run here (None: it can)
    not_rehearsed: str = ""  # rehearse_limit_s 0: why

    def limit(self, rehearse: bool) -> float:
        return self.rehearse_limit_s if rehearse else self.limit_s


# ------------------------------------------------------------------------------------------------
# the driver


def bench_gpu():
    """scripts/bench_gpu.py (its run_bounded, cases and summaries), imported once by path."""
    if "bench_gpu" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPTS / "bench_gpu.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_gpu"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_gpu"]


def write_json(path: Path, data: dict) -> None:
    """`path` rewritten whole, atomically: a reader (or a run killed now) never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def status_of(returncode: int | None, result: dict | None) -> str:
    """pass: ran, every check held; fail: ran, a check did not hold; error: raised or exited
    non-zero (or wrote nothing); timeout: stopped at its limit."""
    if returncode is None:
        return "timeout"
    if returncode != 0 or result is None or "error" in result:
        return "error"
    return "pass" if all(result.get("checks", {}).values()) else "fail"


def run_step(step: Step, ctx: dict, limit_s: float, work: Path, steps_file: Path | None) -> dict:
    """`step` in a child process (`--step`), at most `limit_s` seconds: its JSON entry."""
    ctx_file, result_file = work / f"{step.name}.context.json", work / f"{step.name}.result.json"
    result_file.unlink(missing_ok=True)
    write_json(ctx_file, {**ctx, "limit_s": limit_s})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step", step.name]
    cmd += ["--context", str(ctx_file), "--result", str(result_file)]
    cmd += ["--steps-file", str(steps_file)] if steps_file else []
    r = bench_gpu().run_bounded(cmd, limit_s, cwd=str(work))
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    status = status_of(r.returncode, result)
    entry = {"status": status, "seconds": round(r.seconds, 1), "limit_s": round(limit_s, 1)}
    result = result or {}
    entry |= {k: result[k] for k in ("numbers", "checks", "notes", "context") if k in result}
    if result.get("partial"):
        entry["partial"] = True  # what the step measured before it was stopped
    if status == "timeout":
        entry["error"] = f"stopped at its limit of {limit_s:.0f} s"
    elif status == "error":
        entry["error"] = result.get("error") or f"exit {r.returncode}, no result written"
    if status != "pass":
        entry["output_tail"] = r.output[-TAIL:]
    return entry


def run_check(
    steps: tuple[Step, ...],
    out: Path,
    work: Path,
    budget_s: float,
    rehearse: bool = False,
    only: set[str] | None = None,
    steps_file: Path | None = None,
) -> dict:
    """Every selected step in turn (env always: it finds the profile), the JSON rewritten after
    each. A step gets min(its limit, the time left less the least time of the steps after it
    that fit the budget at all); with less than its own least time left it is skipped."""
    started, deadline = time.monotonic(), time.monotonic() + budget_s
    work = bench_gpu().fresh_dir(work)
    selected = [s for s in steps if not only or s.name in only or s.name == "env"]
    ctx = {"rehearse": rehearse, "work": str(work), "out_dir": str(out.parent)}
    report = {
        "check": "fleetwise GPU check (scripts/gpu_check.py)",
        "schema": SCHEMA,
        "mode": "rehearsal on CPU" if rehearse else "gpu",
        "started": now(),
        "budget_s": budget_s,
        "argv": sys.argv[1:],
        "context": ctx,
        "steps": {s.name: {"status": "pending", "what": s.what} for s in selected},
    }
    for i, step in enumerate(selected):
        # the least times of the later steps that will run as far as is known now (before env has
        # found a GPU, the GPU steps will not) and that fit the budget at all
        later = sum(
            s.reserve_s
            for s in selected[i + 1 :]
            if s.reserve_s <= budget_s and _skip_reason(s, ctx, rehearse) is None
        )
        left = deadline - time.monotonic()
        limit = min(step.limit(rehearse), left - later)
        skip = _skip_reason(step, ctx, rehearse)
        if skip is None and limit < step.reserve_s:
            skip = f"the check's time budget is spent ({left:.0f} s left, {later:.0f} s kept for the steps after it)"
        if skip:
            entry = {"status": "skipped", "reason": skip}
        else:
            print(f"gpu_check: {step.name} (limit {limit:.0f} s) …", flush=True)
            entry = run_step(step, ctx, limit, work, steps_file)
            print(f"gpu_check: {step.name}: {entry['status']} in {entry['seconds']} s", flush=True)
        ctx.update(entry.pop("context", {}))
        report["steps"][step.name] = {"what": step.what, **entry}
        report["context"] = ctx
        report["summary"] = _summary(report["steps"], time.monotonic() - started)
        write_json(out, report)
    report["finished"] = now()
    write_json(out, report)
    return report


def _skip_reason(step: Step, ctx: dict, rehearse: bool) -> str | None:
    if rehearse and step.rehearse_limit_s <= 0:
        return f"not rehearsed on the CPU: {step.not_rehearsed}"
    if step.needs and (reason := step.needs(ctx)):
        return reason
    if rehearse or not step.gpu:
        return None
    if not ctx.get("cuda"):
        return "no CUDA device (see env)"
    if not ctx.get("profile"):
        return f"no hardware profile for {ctx.get('device_name')!r} (fleetwise/calibrate/gpus.py)"
    return None


def _summary(steps: dict, wall_s: float) -> dict:
    counts = {s: sum(1 for e in steps.values() if e["status"] == s) for s in STATUSES}
    bad = [name for name, e in steps.items() if e["status"] in ("fail", "error", "timeout")]
    return {**counts, "wall_s": round(wall_s, 1), "not_passed": bad, "ok": not bad}


# ------------------------------------------------------------------------------------------------
# the step's side (a child process): run one step, write its result


class Result:
    """The child's result file: written at the end, and as `progress` on the way (a step stopped
    at its limit keeps what it measured)."""

    path: Path | None = None
    numbers: dict = {}

    @classmethod
    def progress(cls, **numbers) -> None:
        cls.numbers.update(numbers)
        if cls.path is not None:
            write_json(cls.path, {"numbers": cls.numbers, "partial": True})


def run_child(args: argparse.Namespace) -> int:
    steps = {s.name: s for s in load_steps(args.steps_file)}
    ctx = json.loads(Path(args.context).read_text())
    Result.path = Path(args.result)
    try:
        out = steps[args.step].fn(ctx)
        out["numbers"] = {**Result.numbers, **out.get("numbers", {})}
        write_json(Result.path, out)
        return 0
    except BaseException as err:  # noqa: BLE001 - every failure of a step becomes its JSON entry
        traceback.print_exc()
        write_json(
            Result.path,
            {
                "numbers": Result.numbers,
                "error": f"{type(err).__name__}: {err}"[:2000],
                "traceback": traceback.format_exc()[-TAIL:],
            },
        )
        return 1


def load_steps(steps_file: str | None) -> tuple[Step, ...]:
    """STEPS of this module, or of another file (tests give steps of their own)."""
    if not steps_file:
        return STEPS
    spec = importlib.util.spec_from_file_location("gpu_check_steps", steps_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check_steps"] = module
    spec.loader.exec_module(module)
    return module.STEPS


# ------------------------------------------------------------------------------------------------
# what the steps share


def choose_profile(device_name: str) -> dict | None:
    """The profile a GPU is planned with, by its CUDA name: {"profile", "variant", "hardware" (the
    overrides), "precision"}; None for a part no profile describes."""
    gpu = bench_gpu().hardware_for(device_name)
    if gpu is None:
        return None
    profile = gpu.profile
    return {
        "profile": profile,
        "variant": gpu.variant,
        "hardware": gpu.overrides(),
        "precision": bench_gpu().precision_for(profile),
    }


REHEARSAL_PROFILE = {
    "profile": "cpu",
    "variant": "this machine's CPU",
    "hardware": ["hardware=cpu"],
    "precision": "fp32",
}
COMMON = [
    "checkpoint.enabled=false",
    "tracking.enabled=false",
    "plan.memory_check=warn",
    "optim.warmup_steps=1",
]


def hardware(ctx: dict, devices: int | None = 1) -> list[str]:
    """The profile's overrides (the part's, or the CPU's when rehearsing), on `devices` per node."""
    hw = list(ctx["hardware"])
    return hw + ([f"hardware.devices_per_node={devices}"] if devices else [])


def ratio(a, b) -> float | None:
    return round(a / b, 4) if a and b else None


def metrics(run_dir: Path) -> list[dict]:
    from fleetwise import rundir

    path = rundir.metrics_path(run_dir)
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def left(deadline: float) -> float:
    """Seconds until `deadline` (time.monotonic), at least 1."""
    return max(1.0, deadline - time.monotonic())


def finite(x) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")


# ------------------------------------------------------------------------------------------------
# env


def step_env(ctx: dict) -> dict:
    import importlib.metadata
    import platform

    numbers: dict = {"python": platform.python_version(), "packages": {}}
    for dist in (
        "torch",
        "hydra-core",
        "omegaconf",
        "pydantic",
        "pydantic-core",
        "rich",
        "PyYAML",
        "psutil",
        "numpy",
    ):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            numbers["packages"][dist] = importlib.metadata.version(dist)
    wheelhouse = REPO / ".whl" / "BUILD.json"
    if wheelhouse.exists():
        build = json.loads(wheelhouse.read_text())
        numbers["wheelhouse"] = {k: build.get(k) for k in ("commit", "dirty", "wheels_bytes", "tree_bytes")}
    Result.progress(**numbers)  # kept if what follows fails (no fleetwise, no torch)
    import fleetwise

    numbers["fleetwise"] = str(Path(fleetwise.__file__).parent)
    numbers["fleetwise_files_differing_from_tree"] = differing_files(Path(fleetwise.__file__).parent)
    Result.progress(**numbers)
    import torch

    numbers |= {
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    cuda = torch.cuda.is_available()
    checks = {"fleetwise_matches_tree": numbers["fleetwise_files_differing_from_tree"] == []}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name(0)
        numbers |= {
            "device_name": name,
            "device_count": torch.cuda.device_count(),
            "total_memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "nccl": str(torch.cuda.nccl.version()),
            "bf16": torch.cuda.is_bf16_supported(including_emulation=False),
        }
        chosen = choose_profile(name)
    else:
        name, chosen = "", REHEARSAL_PROFILE if ctx["rehearse"] else None
    numbers["profile"] = chosen
    if not ctx["rehearse"]:
        checks |= {"cuda_available": cuda, "profile_known": chosen is not None}
    context = {"cuda": cuda, "device_name": name, **(chosen or {})}
    return {"numbers": numbers, "checks": checks, "context": context}


def differing_files(installed: Path) -> list[str]:
    """The .py files of the installed fleetwise that differ from this tree's platform/fleetwise
    (a wheelhouse built from another commit)."""
    tree = REPO / "platform" / "fleetwise"
    if not tree.is_dir() or installed.resolve() == tree.resolve():
        return []
    differ = []
    for path in sorted(tree.rglob("*.py")):
        rel = path.relative_to(tree)
        other = installed / rel
        if not other.exists() or other.read_bytes() != path.read_bytes():
            differ.append(rel.as_posix())
    return differ[:50]


# ------------------------------------------------------------------------------------------------
# the 1-GPU bench (scripts/bench_gpu.py's runs)

REHEARSE_MODELS = {
    "gpt3_1.3b": ["recipe=gpt/tiny", "train.micro_batch_size=2", "train.global_batch_size=4"],
    "resnet50": ["recipe=resnet/tiny", "train.micro_batch_size=4", "train.global_batch_size=4"],
}


def bench_case(ctx: dict, model: str) -> tuple[str, list[str]]:
    """bench_gpu's 1-GPU case of `model` on the context's profile (tiny models when rehearsing)."""
    b = bench_gpu()
    name, overrides = next(
        c for c in b.cases(ctx["profile"], 1, b.QUICK_STEPS, hardware(ctx, None)) if c[0].startswith(model)
    )
    if ctx["rehearse"]:
        replaced = ("recipe=", "train.micro_batch_size=", "train.global_batch_size=", "train.precision=")
        overrides = [o for o in overrides if not o.startswith(replaced)]
        overrides += [*REHEARSE_MODELS[model], "train.precision=fp32"]
    return name, overrides


def bench_row_checks(row: dict) -> dict:
    """What a bench run must show: it trained, its loss is finite, and the plan's memory and step
    time are near what the run measured (the planner's promise on this GPU)."""
    if "error" in row:
        return {"trained": False}
    mem = row.get("predicted_over_allocated")
    step = ratio(row.get("step_s"), row.get("planned_step_s"))
    return {
        "trained": True,
        "loss_finite": finite(row.get("loss")),
        "plan_memory_within_25pct": mem is not None and 0.75 <= mem <= 1.25,
        "plan_step_time_within_2x": step is not None and 0.5 <= step <= 2.0,
    }


def _bench(ctx: dict, model: str) -> dict:
    b = bench_gpu()
    name, overrides = bench_case(ctx, model)
    runs = b.fresh_dir(Path(ctx["work"]) / f"bench_{model}")
    row = b.run(name, overrides, runs, timeout_s=max(10.0, ctx["limit_s"] - 10))
    row["step_over_planned"] = ratio(row.get("step_s"), row.get("planned_step_s"))
    row["mfu_over_planned"] = ratio(row.get("mfu"), row.get("planned_mfu"))
    out = {"numbers": row, "checks": bench_row_checks(row)}
    if ctx["rehearse"]:  # a shared CPU's load decides its step time: reported, not held to the plan
        row["plan_step_time_within_2x"] = out["checks"].pop("plan_step_time_within_2x", None)
    if "error" in row:
        out["error"] = f"{name}: {row['error']}"
    return out


def step_bench_gpt(ctx: dict) -> dict:
    return _bench(ctx, "gpt3_1.3b")


def step_bench_resnet(ctx: dict) -> dict:
    return _bench(ctx, "resnet50")


# ------------------------------------------------------------------------------------------------
# rank 0 of an 8-GPU ZeRO-3 + offload job, the other ranks faked

WORLD = 8


def zero3_overrides(ctx: dict) -> list[str]:
    model = ["recipe=gpt/tiny"] if ctx["rehearse"] else ["recipe=gpt/gpt3_1.3b"]
    return [
        *model,
        "strategy=sharding",
        "strategy.sharding_stage=3",
        "strategy.offload=true",
        *hardware(ctx, WORLD),
        f"train.precision={ctx['precision']}",
        "train.micro_batch_size=2",
        f"train.global_batch_size={2 * WORLD}",
        "train.steps=4",
        "train.log_interval=1000",
        *COMMON,
    ]


@contextlib.contextmanager
def mirrored_collectives():
    """The fake backend's collectives move nothing, so their outputs would hold whatever memory
    was there (NaN as likely as not). Here every peer mirrors this rank: an all-gather's output is
    this rank's input repeated, a reduce-scatter's is this rank's chunk of its input (every rank
    reduced the same values, averaged), an all-reduce keeps this rank's values. A real copy per
    collective, on the stream it was issued on, as a real collective writes its output there."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def gather_into(original):
        def call(output_tensor, input_tensor, group=None, async_op=False):
            work = original(output_tensor, input_tensor, group=group, async_op=async_op)
            n = output_tensor.numel() // max(1, input_tensor.numel())
            output_tensor.view(n, -1).copy_(input_tensor.reshape(1, -1).expand(n, -1))
            return work

        return call

    def scatter_from(original):
        def call(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            work = original(output, input, op=op, group=group, async_op=async_op)
            n = input.numel() // max(1, output.numel())
            rank = dist.get_rank(group) if group is not None else dist.get_rank()
            output.view(-1).copy_(input.reshape(n, -1)[rank % n])
            return work

        return call

    def gather_list(original):
        def call(tensor_list, tensor, group=None, async_op=False):
            work = original(tensor_list, tensor, group=group, async_op=async_op)
            for t in tensor_list:
                t.copy_(tensor)
            return work

        return call

    wrappers = {
        "all_gather_into_tensor": gather_into,
        "all_gather_single": gather_into,
        "reduce_scatter_tensor": scatter_from,
        "reduce_scatter_single": scatter_from,
        "all_gather": gather_list,
    }
    saved = []
    for name in wrappers:
        for module in (dist, c10d):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
    originals = {name: getattr(c10d, name) for name in wrappers if hasattr(c10d, name)}
    for module, name, _ in saved:
        setattr(module, name, wrappers[name](originals[name]))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def step_zero3_offload(ctx: dict) -> dict:
    import torch

    from fleetwise.config.validate import load_config
    from fleetwise.dryrun.fake import join_fake_world
    from fleetwise.plan import make_plan
    from fleetwise.runtime.mesh import DistEnv
    from fleetwise.runtime.trainer import Trainer

    cfg = load_config(zero3_overrides(ctx))
    plan = make_plan(cfg)
    cuda = torch.cuda.is_available() and not ctx["rehearse"]
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # NCCL + gloo (offload's host tensors) in the real job: fake for both device types here
    join_fake_world(0, WORLD, "cpu:fake,cuda:fake" if cuda else "fake")
    planned = {
        "memory_bytes": plan.memory_bytes,
        "host_memory_bytes": plan.stages[0]["host_memory_bytes"] if plan.stages else None,
        "step_time_s": plan.step_time_s,
        "time_s": plan.time_s,
        "step_time_without_comm_s": plan.step_time_s - exposed_comm(plan.time_s),
    }
    Result.progress(plan=planned, world=WORLD, overrides=zero3_overrides(ctx))
    run_dir = Path(ctx["work"]) / "zero3"
    run_dir.mkdir(parents=True, exist_ok=True)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    with mirrored_collectives():
        started = time.perf_counter()
        trainer = Trainer(cfg, plan, DistEnv(0, WORLD, 0, device, 0), run_dir)
        sync()
        built = time.perf_counter() - started
        times, peaks, records = [], [], []
        for step in range(1, cfg.train.steps + 1):
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            records += trainer.train_step(step)
            sync()
            times.append(time.perf_counter() - t)
            peaks.append(torch.cuda.max_memory_allocated(device) if cuda else trainer.memory.peak)
            Result.progress(step_times_s=times, peak_allocated_bytes=peaks)
    return zero3_result(plan, planned, times, peaks, records, built, cuda, device)


def exposed_comm(time_s: dict) -> float:
    """The communication time the plan leaves exposed: every mesh dimension's, less what hides."""
    comm = sum(v for k, v in time_s.items() if k.startswith("comm_") and k != "comm_hidden")
    return max(0.0, comm - time_s.get("comm_hidden", 0.0))


def zero3_result(plan, planned, times, peaks, records, built, cuda, device) -> dict:
    import resource

    import torch

    from fleetwise.rundir import Metric

    steady_times, steady_peak = times[1:] or times, max(peaks[1:] or peaks)
    step = sorted(steady_times)[len(steady_times) // 2]
    numbers = {
        "build_s": round(built, 2),
        "step_times_s": [round(t, 4) for t in times],
        "step_s": step,
        "planned_step_s": plan.step_time_s,
        "planned_step_without_comm_s": planned["step_time_without_comm_s"],
        "step_over_planned_without_comm": ratio(step, planned["step_time_without_comm_s"]),
        "peak_allocated_bytes": steady_peak,
        "first_step_peak_bytes": peaks[0],
        "planned_bytes": plan.memory_bytes["total"],
        "planned_over_allocated": ratio(plan.memory_bytes["total"], steady_peak),
        "reserved_bytes": torch.cuda.memory_reserved(device) if cuda else None,
        "host_rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "planned_host_bytes": planned["host_memory_bytes"],
        "loss": records[-1][Metric.LOSS] if records else None,
    }
    checks = {
        "steps_ran": len(times) == 4,
        "plan_memory_within_25pct": 0.75 <= (numbers["planned_over_allocated"] or 0) <= 1.25,
    }
    notes = [
        "the 7 other ranks are faked: no collective moves data or time, so the measured step is the "
        "plan's step without its exposed communication (planned_step_without_comm_s); offload's "
        "host copies and the host optimizer step are real"
    ]
    return {"numbers": numbers, "checks": checks, "notes": notes}


# ------------------------------------------------------------------------------------------------
# host-device synchronizations per step


def step_sync_count(ctx: dict) -> dict:
    import warnings
    from collections import Counter

    import torch
    import torch.distributed as dist

    from fleetwise.config.validate import load_config
    from fleetwise.plan import make_plan
    from fleetwise.runtime.mesh import DistEnv
    from fleetwise.runtime.trainer import Trainer

    cuda = torch.cuda.is_available() and not ctx["rehearse"]
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    work = Path(ctx["work"])
    store = dist.FileStore(str(work / "sync_store"), 1)
    kwargs = {"device_id": device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1, **kwargs)
    steps, numbers, checks = 6, {}, {}
    models = {"gpt": ["recipe=gpt/tiny"], "resnet": ["recipe=resnet/tiny", "train.micro_batch_size=4"]}
    for label, model in models.items():
        overrides = [*model, *hardware(ctx), f"train.precision={ctx['precision']}"]
        overrides += [f"train.steps={steps}", "train.log_interval=1000", "train.global_batch_size=8", *COMMON]
        cfg = load_config(overrides)
        trainer = Trainer(cfg, make_plan(cfg), DistEnv(0, 1, 0, device, 0), work / f"sync_{label}")
        counts, messages = [], Counter()
        for step in range(1, steps + 1):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    trainer.train_step(step)
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode("default")
            syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
            counts.append(len(syncs))
            messages.update(m.splitlines()[0][:200] for m in syncs)
        reading = [s for s in range(1, steps + 1) if trainer.reads_host(s)]
        between = [c for s, c in enumerate(counts, start=1) if s not in reading]
        numbers[label] = {
            "syncs_per_step": counts,
            "reading_steps": reading,
            "syncs_between_reading_steps": sum(between),
            "messages": dict(messages.most_common(5)),
        }
        checks[f"{label}_no_sync_between_reading_steps"] = sum(between) == 0
    notes = [] if cuda else ["rehearsal on the CPU: no device, nothing to synchronize (the counts are 0)"]
    return {"numbers": numbers, "checks": checks, "notes": notes}


# ------------------------------------------------------------------------------------------------
# NCCL communicators' device memory


def step_nccl_comms(ctx: dict) -> dict:
    import torch
    import torch.distributed as dist

    from fleetwise.config.layout import Layout

    cuda = torch.cuda.is_available() and not ctx["rehearse"]
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    work = Path(ctx["work"])

    def free() -> int | None:
        if not cuda:
            return None
        torch.cuda.synchronize(device)
        return torch.cuda.mem_get_info(device)[0]

    def reserved() -> int | None:
        return torch.cuda.memory_reserved(device) if cuda else None

    x = torch.ones(1024, device=device)  # the CUDA context first: not a communicator's
    marks = {"context": (free(), reserved())}
    store = dist.FileStore(str(work / "comms_store"), 1)
    kwargs = {"device_id": device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1, **kwargs)
    dist.all_reduce(x)
    marks["world"] = (free(), reserved())
    Layout().build_mesh(device.type)  # the runtime's 4D mesh: on 1 rank every dim is the world's
    marks["mesh"] = (free(), reserved())
    groups = []
    for _ in range(4):  # what a rank of a 4D layout splits off, one per mesh dimension
        group = dist.new_group([0])
        dist.all_reduce(x, group=group)  # a communicator is set up at its first collective
        groups.append(group)
    marks["four_more"] = (free(), reserved())
    return nccl_comms_result(marks, cuda, torch.cuda.nccl.version() if cuda else None)


def nccl_comms_result(marks: dict, cuda: bool, nccl_version) -> dict:
    """The device memory each stage took outside PyTorch's allocator (free memory lost less what
    the allocator reserved), from (free, reserved) marks."""

    def outside(a: str, b: str) -> int | None:
        (free_a, res_a), (free_b, res_b) = marks[a], marks[b]
        if free_a is None or free_b is None:
            return None
        return (free_a - free_b) - (res_b - res_a)

    numbers = {
        "nccl": str(nccl_version) if nccl_version else None,
        "world_communicator_bytes": outside("context", "world"),
        "mesh_bytes": outside("world", "mesh"),
        "one_rank_communicators_bytes": outside("mesh", "four_more"),
        "per_one_rank_communicator_bytes": (outside("mesh", "four_more") or 0) / 4 if cuda else None,
        "allocator_reserved_delta_bytes": (marks["four_more"][1] - marks["context"][1]) if cuda else None,
        "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }
    notes = [
        "measured on 1 GPU: a world of 1 and 1-rank groups, whose NCCL communicators open no channel "
        "to a peer. Not measurable here: the per-peer buffers (NCCL_BUFFSIZE per channel and peer, "
        "up to 32 channels over NVLink), NVLS buffers (NVSwitch, 2+ GPUs), point-to-point "
        "connections of pipeline stages -- what an 8-GPU node adds per communicator; `fleetwise "
        "plan` notes how many communicators a layout creates (plan/planner.py nccl_communicators)",
    ]
    if not cuda:
        notes.append("rehearsal on the CPU: gloo groups, no device memory to measure")
    return {"numbers": numbers, "checks": {"process_groups_created": True}, "notes": notes}


# ------------------------------------------------------------------------------------------------
# calibrate


def step_calibrate(ctx: dict) -> dict:
    import yaml

    b = bench_gpu()
    work, out_dir = Path(ctx["work"]), Path(ctx["out_dir"])
    written = work / "calibrated.yaml"
    cmd = [sys.executable, "-m", "fleetwise", "calibrate", "--no-comm", "--json", "--name", "gpucheck"]
    r = b.run_bounded([*cmd, "--out", str(written)], max(10.0, ctx["limit_s"] - 5))
    if r.returncode != 0:
        raise RuntimeError(
            f"fleetwise calibrate: {'timed out' if r.timed_out else r.returncode}: {r.output[-1500:]}"
        )
    report = json_object_with(r.output, "measured")
    shutil.copy2(written, out_dir / "gpu_check_profile.yaml")
    from fleetwise.calibrate.gpus import datasheet_peaks, known_gpu
    from fleetwise.config.paths import config_dir

    gpu = known_gpu(ctx.get("device_name", ""))
    shipped = yaml.safe_load((config_dir() / "hardware" / f"{ctx['profile']}.yaml").read_text())
    if gpu:
        for key, value in gpu.differs.items():
            if "." not in key:
                shipped[key] = value
    return calibration_result(
        report["measured"], shipped, datasheet_peaks(gpu) if gpu else {}, ctx["precision"]
    )


def json_object_with(text: str, key: str) -> dict:
    """The first JSON object in `text` that starts a line and has `key` (a command's --json output
    among its warnings: stdout and stderr come together)."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"(?m)^\{", text):
        with contextlib.suppress(json.JSONDecodeError):
            obj, _ = decoder.raw_decode(text, match.start())
            if isinstance(obj, dict) and key in obj:
                return obj
    raise ValueError(f"no JSON object with {key!r} in the output: {text[-1500:]}")


def calibration_result(measured: dict, shipped: dict, datasheet: dict, precision: str) -> dict:
    """What `calibrate --json` measured against the part's shipped profile and datasheet."""
    curve = measured.get("gemm_curve") or {}
    keys = ("elementwise_ns", "grad_accumulate_ns", "host_link_gbps", "op_overhead_us", "matmul_efficiency")
    numbers = {
        "peak_flops": measured.get("peak_flops"),
        "measured_peak_flops": measured.get("measured_peak_flops"),
        "best_gemm_over_datasheet": ratio(
            (measured.get("measured_peak_flops") or {}).get(precision), datasheet.get(precision)
        ),
        "gemm_curve": curve,
        "host_to_device_gbps": measured.get("host_to_device_gbps"),
        "device_to_host_gbps": measured.get("device_to_host_gbps"),
        "measured": {k: measured.get(k) for k in keys},
        "shipped_profile": {k: shipped.get(k) for k in keys},
        "measured_over_shipped": {k: ratio(measured.get(k), shipped.get(k)) for k in keys},
        "notes": measured.get("notes"),
    }
    checks = {"profile_written": True}
    if datasheet:
        peak = (measured.get("peak_flops") or {}).get(precision)
        checks["peak_is_the_datasheets"] = peak is not None and abs(peak / datasheet[precision] - 1) < 1e-3
        checks["curve_tops_below_1"] = bool(curve) and max(curve.values()) < 1.0
    return {"numbers": numbers, "checks": checks}


# ------------------------------------------------------------------------------------------------
# fp16 + torch.compile + checkpoint/resume

FP16_MODEL = [
    "recipe=gpt/tiny",
    "model.hidden_size=256",
    "model.ffn_hidden_size=1024",
    "model.seq_len=128",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
]


def fp16_overrides(ctx: dict, steps: int) -> list[str]:
    rehearse = ctx["rehearse"]
    return [
        *(["recipe=gpt/tiny"] if rehearse else FP16_MODEL),
        *hardware(ctx),
        f"train.precision={'fp32' if rehearse else 'fp16'}",
        f"train.compile={'false' if rehearse else 'true'}",  # inductor on 2 shared cores: minutes
        f"train.steps={steps}",
        "train.log_interval=1",
        "optim.warmup_steps=1",
        "checkpoint.enabled=true",
        "checkpoint.interval=3",
        "checkpoint.keep=3",
        "tracking.enabled=false",
        "plan.memory_check=warn",
    ]


def step_fp16_resume(ctx: dict) -> dict:
    """Run A trains 6 steps, checkpointing at 3 and 6; run B resumes A's step-3 checkpoint in a new
    run directory and trains 4..6: its losses must be A's (same data, weights, RNG)."""
    from fleetwise.rundir import Metric

    b = bench_gpu()
    work = b.fresh_dir(Path(ctx["work"]) / "fp16")
    a_dir, b_dir = work / "a", work / "b"
    deadline = time.monotonic() + ctx["limit_s"] - 5
    a = b.run_bounded([*b.TRAIN, *fp16_overrides(ctx, 6), f"run.dir={a_dir}"], left(deadline))
    if a.returncode != 0:
        raise RuntimeError(f"run A: {'timed out' if a.timed_out else a.returncode}: {a.output[-1500:]}")
    first = metrics(a_dir)
    Result.progress(a_seconds=round(a.seconds, 1), a_losses=[r.get(Metric.LOSS) for r in first])
    checkpoint = a_dir / "checkpoints" / "step_00000003"
    resume = [*fp16_overrides(ctx, 6), f"checkpoint.resume={checkpoint}", f"run.dir={b_dir}"]
    r = b.run_bounded([*b.TRAIN, *resume], left(deadline))
    if r.returncode != 0:
        raise RuntimeError(
            f"run B (resumed): {'timed out' if r.timed_out else r.returncode}: {r.output[-1500:]}"
        )
    log = (a_dir / "logs" / "rank_0.log").read_text() if (a_dir / "logs" / "rank_0.log").exists() else ""
    return fp16_result(first, metrics(b_dir), log, a.seconds, r.seconds, ctx["rehearse"])


def fp16_result(
    first: list[dict], resumed: list[dict], log: str, a_s: float, b_s: float, rehearse: bool
) -> dict:
    """Run B's steps against run A's same steps."""
    from fleetwise.rundir import Metric

    loss, scale = Metric.LOSS, Metric.LOSS_SCALE
    by_step = {r["step"]: r for r in first}
    graphs = re.search(r"torch\.compile: (\d+) graph\(s\) compiled for the blocks, (\d+) graph break", log)
    pairs = [(by_step[r["step"]], r) for r in resumed if r["step"] in by_step]
    diffs = [abs(x[loss] - y[loss]) / max(abs(x[loss]), 1e-12) for x, y in pairs]
    numbers = {
        "a_seconds": round(a_s, 1),
        "b_seconds": round(b_s, 1),
        "a_losses": [r.get(loss) for r in first],
        "b_steps": [r["step"] for r in resumed],
        "b_losses": [r.get(loss) for r in resumed],
        "max_relative_loss_difference": max(diffs) if diffs else None,
        "a_loss_scale": [r.get(scale) for r in first],
        "b_loss_scale": [r.get(scale) for r in resumed],
        "compiled_graphs": int(graphs.group(1)) if graphs else None,
        "graph_breaks": int(graphs.group(2)) if graphs else None,
        "a_step_s": [r.get(Metric.STEP_TIME) for r in first],
    }
    checks = {
        "a_trained_6_steps": [r["step"] for r in first] == [1, 2, 3, 4, 5, 6],
        "losses_finite": all(finite(r.get(loss)) for r in first + resumed),
        "resumed_at_step_4": numbers["b_steps"][:1] == [4],
        "resumed_losses_match": bool(diffs) and max(diffs) < 2e-2,
    }
    if not rehearse:
        checks["compiled"] = (numbers["compiled_graphs"] or 0) > 0
    notes = ["loss scale after resume vs before: a_loss_scale[3:] against b_loss_scale (GradScaler state)"]
    return {"numbers": numbers, "checks": checks, "notes": notes}


# ------------------------------------------------------------------------------------------------
# one tracked run

MLFLOW_SITE = "FLEETWISE_GPU_CHECK_MLFLOW_SITE"  # set by gpu_check.sh where .whl/mlflow installed
READ_BACK = """
import json, sys
from mlflow import MlflowClient
client = MlflowClient(sys.argv[1])
runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
run = runs[0]
print(json.dumps({"runs": len(runs), "status": run.info.status, "metrics": sorted(run.data.metrics),
                  "params": len(run.data.params), "tags": sorted(run.data.tags)}))
"""


def mlflow_missing(ctx: dict) -> str | None:
    if os.environ.get(MLFLOW_SITE) or importlib.util.find_spec("mlflow") is not None:
        return None
    return (
        "MLflow is not installed (build the wheelhouse with it: make gpu-wheelhouse; every other step "
        "trains with tracking.enabled=false and needs none of it)"
    )


def step_tracking(ctx: dict) -> dict:
    b = bench_gpu()
    work = b.fresh_dir(Path(ctx["work"]) / "tracking")
    env = dict(os.environ)
    site = os.environ.get(MLFLOW_SITE)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), site) if p)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    env |= {"MLFLOW_TRACKING_URI": uri}
    overrides = ["recipe=gpt/tiny", *hardware(ctx), f"train.precision={ctx['precision']}", "train.steps=3"]
    overrides += ["tracking.enabled=true", "tracking.log_model=false", f"run.dir={work / 'run'}"]
    deadline = time.monotonic() + ctx["limit_s"] - 5
    r = b.run_bounded([*b.TRAIN, *overrides], left(deadline), env=env, cwd=str(work))
    if r.returncode != 0:
        raise RuntimeError(f"tracked run: {'timed out' if r.timed_out else r.returncode}: {r.output[-1500:]}")
    read = b.run_bounded([sys.executable, "-c", READ_BACK, uri], left(deadline), env=env)
    if read.returncode != 0:
        raise RuntimeError(f"reading the run back: {read.output[-1500:]}")
    run = json.loads(read.output.strip().splitlines()[-1])
    gpu_metrics = [m for m in run["metrics"] if m.startswith("system/gpu")]
    numbers = {**run, "train_seconds": round(r.seconds, 1), "gpu_system_metrics": gpu_metrics}
    from fleetwise.rundir import Metric

    checks = {"run_finished": run["status"] == "FINISHED", "mfu_logged": Metric.MFU in run["metrics"]}
    if not ctx["rehearse"]:
        checks["gpu_system_metrics"] = bool(gpu_metrics)
    return {"numbers": numbers, "checks": checks}


# ------------------------------------------------------------------------------------------------

STEPS: tuple[Step, ...] = (
    Step("env", step_env, 60, 10, 90, gpu=False, what="torch, CUDA, the GPU and packages; the profile"),
    Step("bench_gpt", step_bench_gpt, 130, 60, 180, what="GPT-3 1.3B bf16 on 1 GPU vs its plan"),
    Step("bench_resnet", step_bench_resnet, 100, 40, 180, what="ResNet-50 bf16 on 1 GPU vs its plan"),
    Step(
        "zero3_offload", step_zero3_offload, 120, 45, 150, what="rank 0 of 8, ZeRO-3 + offload, peers faked"
    ),
    Step("sync_count", step_sync_count, 60, 20, 120, what="host-device syncs per step (sync debug mode)"),
    Step("nccl_comms", step_nccl_comms, 45, 15, 60, what="NCCL communicators' memory outside the allocator"),
    Step(
        "calibrate",
        step_calibrate,
        90,
        30,
        0,
        what="fleetwise calibrate --no-comm vs the shipped profile",
        not_rehearsed="there `fleetwise calibrate` measures the host's costs for minutes (on a GPU only the "
        "device's, in seconds); its result's reading is unit-tested (tests/unit/scripts/test_gpu_check.py)",
    ),
    Step("fp16_resume", step_fp16_resume, 180, 70, 240, what="fp16 + torch.compile, resumed mid-run"),
    Step(
        "tracking",
        step_tracking,
        60,
        25,
        150,
        what="one run tracked in MLflow, GPU system metrics",
        needs=mlflow_missing,
    ),
)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    default_out = (
        Path(os.environ["OUT"]) / "gpu_check.json"
        if os.environ.get("OUT")
        else REPO / "gpu_check_out" / "gpu_check.json"
    )
    p.add_argument("--out", type=Path, default=default_out, help="the JSON (default $OUT/gpu_check.json)")
    p.add_argument(
        "--work", type=Path, default=Path("/tmp/fleetwise-gpu-check/work"), help="scratch (cleared)"
    )
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole check, at most")
    p.add_argument(
        "--only", type=lambda s: {x.strip() for x in s.split(",") if x.strip()}, help="steps to run"
    )
    p.add_argument("--rehearse", action="store_true", help="every step on this CPU, tiny models")
    p.add_argument("--step", help=argparse.SUPPRESS)  # the child side: run one step
    p.add_argument("--context", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--steps-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = {s.name for s in load_steps(args.steps_file)}
    unknown = (args.only or set()) - names
    if unknown:
        p.error(f"unknown step(s) {sorted(unknown)}; steps: {', '.join(sorted(names))}")
    return args


def main(argv: list[str] | None = None) -> int:
    # run as a script this module is __main__: steps of another file import it as gpu_check, and
    # must find this same module (its Result, which the child writes)
    sys.modules.setdefault("gpu_check", sys.modules[__name__])
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.step:
        code = run_child(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # process groups and compiled graphs need no teardown
    steps = load_steps(args.steps_file)
    steps_file = Path(args.steps_file) if args.steps_file else None
    report = run_check(steps, args.out, args.work, args.budget_s, args.rehearse, args.only, steps_file)
    s = report["summary"]
    print(
        f"gpu_check: {s['pass']} passed, {s['fail']} failed, {s['error']} errors, {s['timeout']} timed out, "
        f"{s['skipped']} skipped in {s['wall_s']} s; {args.out}",
        flush=True,
    )
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
