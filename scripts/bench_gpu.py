"""GPU suite of scripts/bench.py: `fleetwise train` itself -- the trainer, its engines and its
metrics -- on one GPU and on all GPUs of the node, bf16 (fp16 where the GPU has no bf16), for
GPT-3 1.3B and ResNet-50. Per run: step time, MFU (against the profile's datasheet peak, as the
trainer reports it), tokens/s or samples/s, and the allocator's peak allocated and reserved bytes
against the plan's prediction and its usable memory.

    python scripts/bench_gpu.py OUT.json [--quick] [--timeout-s SECONDS]

Without CUDA it writes {"skipped": "..."} and exits 0. Nothing here is tuned per GPU: the runs
use the recipes' layouts with a short batch, so the first session with a GPU measures all of it
in one command (and the planner's memory and time models meet real numbers).

The GPU is planned with the profile of its part (fleetwise/calibrate/gpus.py): an H100 PCIe or NVL
card with the h100 profile and its own datasheet's peak and memory (the profile is the SXM board's,
which read MFU 1.3x high on a PCIe card), an H200 with h200. OUT is rewritten on every run and the
runs' folder (OUT with the suffix .runs) is cleared first, so a second run into the same OUT
measures again. Each `fleetwise train` runs as `python -m fleetwise` (no console script needed on
the PATH) under a time limit; a run past it is stopped with every process it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # fleetwise loads inside the functions: scripts/gpu_check.py imports this module
    from fleetwise.calibrate.gpus import KnownGPU  # before it knows fleetwise is installed

WARMUP = 3  # leading steps left out (allocator warm-up, cuDNN/cuBLAS autotuning, NCCL set-up)
STEPS, QUICK_STEPS = 12, 6
RUN_TIMEOUT_S = 900.0  # one `fleetwise train`: start-up, model build and every step
TRAIN = [sys.executable, "-m", "fleetwise", "train"]  # this interpreter's fleetwise, not a PATH lookup
# recipe, layout on one GPU, layout on a node, micro-batch, accumulation
MODELS = {
    "gpt3_1.3b": (
        "gpt/gpt3_1.3b",
        ("strategy=dp",),
        ("strategy=sharding", "strategy.sharding_stage=2"),
        2,
        2,
    ),
    "resnet50": ("resnet/resnet50", ("strategy=dp",), ("strategy=dp",), 64, 1),
}


def hardware_for(device_name: str) -> KnownGPU | None:
    """The part a CUDA device name is, with the profile it is planned with (None: no profile)."""
    from fleetwise.calibrate.gpus import known_gpu

    return known_gpu(device_name)


def profile_for(device_name: str) -> str | None:
    """The hardware profile of a GPU by its CUDA name ("NVIDIA H100 80GB HBM3" -> h100)."""
    gpu = hardware_for(device_name)
    return gpu.profile if gpu else None


def precision_for(profile: str) -> str:
    """bf16, except on GPUs without native bf16 (V100), which train in fp16."""
    return "fp16" if profile == "v100" else "bf16"


def cases(
    profile: str, gpus: int, steps: int, hardware: list[str] | None = None
) -> list[tuple[str, list[str]]]:
    """(name, overrides) of every run: each model on 1 GPU and on all `gpus` of the node.
    hardware: the overrides that select the part's profile (KnownGPU.overrides); default
    `hardware=<profile>`."""
    out = []
    for name, (recipe, one, node, micro, accumulate) in MODELS.items():
        for devices in sorted({1, gpus}):
            layout = one if devices == 1 else node
            out.append(
                (
                    f"{name}_{devices}gpu",
                    [
                        f"recipe={recipe}",
                        *layout,
                        *(hardware or [f"hardware={profile}"]),
                        f"hardware.devices_per_node={devices}",
                        f"train.precision={precision_for(profile)}",
                        f"train.micro_batch_size={micro}",
                        f"train.global_batch_size={micro * accumulate * devices}",
                        f"train.steps={steps}",
                        "optim.warmup_steps=1",  # the recipes warm up over hundreds of steps
                        f"train.warmup_steps_excluded={WARMUP}",
                        "checkpoint.enabled=false",
                        "tracking.enabled=false",
                        "plan.memory_check=warn",  # measure what the planner doubts, too
                    ],
                )
            )
    return out


def summarize(records: list[dict], plan: dict) -> dict:
    """The steady-state numbers of one run from its metrics.jsonl records and plan.json."""
    from fleetwise.rundir import Metric

    steady = [r for r in records if r["step"] > WARMUP] or records
    allocated = max(r[Metric.PEAK_BYTES_MAX] for r in records)
    reserved = max(r.get(Metric.RESERVED_BYTES_MAX, 0.0) for r in records)
    predicted = float(plan["memory_bytes"]["total"])
    usable = float(plan.get("usable_memory_bytes") or plan["device_memory_bytes"])
    row = {
        "steps": len(records),
        "first_step_s": records[0][Metric.STEP_TIME],
        "step_s": statistics.median(r[Metric.STEP_TIME] for r in steady),
        "planned_step_s": plan["step_time_s"],
        "mfu": statistics.median(r[Metric.MFU] for r in steady),
        "planned_mfu": plan["mfu"],
        "samples_per_s": statistics.median(r[Metric.SAMPLES_PER_S] for r in steady),
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "predicted_bytes": predicted,
        "usable_bytes": usable,
        "predicted_over_allocated": predicted / allocated if allocated else None,
        "reserved_over_usable": reserved / usable if usable else None,
        "plan_fits": plan["fits"],
        "loss": records[-1].get(Metric.LOSS),
    }
    if Metric.TOKENS_PER_S in steady[0]:
        row["tokens_per_s"] = statistics.median(r[Metric.TOKENS_PER_S] for r in steady)
    return row


@dataclass
class Bounded:
    """How a command run under a time limit ended."""

    returncode: int | None  # None: stopped at the limit
    output: str  # stdout and stderr together
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_bounded(cmd: list[str], timeout_s: float, **popen) -> Bounded:
    """Run `cmd` in a process group of its own for at most `timeout_s` seconds. Past the limit the
    whole group is stopped (SIGTERM, then SIGKILL): `fleetwise train` starts torchrun, which starts
    the ranks, and a rank left behind holds its GPU's memory through every run after it."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
        **popen,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return Bounded(proc.returncode, out, time.perf_counter() - started)
    except subprocess.TimeoutExpired:
        out = _stop_group(proc)
        return Bounded(None, out, time.perf_counter() - started)


def _stop_group(proc: subprocess.Popen) -> str:
    """SIGTERM the process group (torchrun passes it on to the ranks), SIGKILL what is left after
    10 s; the output so far."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the whole group is gone
            break
        try:
            out, _ = proc.communicate(timeout=10.0)
            _kill_leftovers(proc.pid)
            return out or ""
        except subprocess.TimeoutExpired:
            continue
    try:
        return proc.communicate(timeout=10.0)[0] or ""
    except subprocess.TimeoutExpired:
        return ""


def _kill_leftovers(pgid: int) -> None:
    """Children of the group that outlived its leader (a rank whose parent already exited)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def fresh_dir(path: Path) -> Path:
    """`path` as an empty folder (what an earlier run left there is removed: `fleetwise train`
    refuses a run directory that holds another job's files)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def run(
    name: str, overrides: list[str], out_dir: Path, timeout_s: float = RUN_TIMEOUT_S, train: list[str] = TRAIN
) -> dict:
    """One `fleetwise train` of `overrides` into out_dir/name (which must not hold an earlier
    run's files: see fresh_dir) under `timeout_s`: its summary, or its error."""
    from fleetwise import rundir

    run_dir = out_dir / name
    r = run_bounded([*train, *overrides, f"run.dir={run_dir}"], timeout_s)
    row = {"name": name, "overrides": overrides, "seconds": round(r.seconds, 1)}
    if r.timed_out:
        return {**row, "error": f"timed out after {timeout_s:.0f} s", "output_tail": r.output[-2000:]}
    if r.returncode != 0:
        return {**row, "error": f"exit {r.returncode}", "output_tail": r.output[-2000:]}
    records = [json.loads(x) for x in rundir.metrics_path(run_dir).read_text().splitlines() if x.strip()]
    plan = json.loads((run_dir / rundir.PLAN_FILE).read_text())
    return {**row, **summarize(records, plan)}


def bench(
    out: Path,
    profile: str,
    gpus: int,
    steps: int,
    hardware: list[str] | None = None,
    timeout_s: float = RUN_TIMEOUT_S,
    train: list[str] = TRAIN,
) -> list[dict]:
    """Every case's row; the runs go to a fresh OUT.runs folder."""
    runs_dir = fresh_dir(out.with_suffix(".runs"))
    return [run(name, o, runs_dir, timeout_s, train) for name, o in cases(profile, gpus, steps, hardware)]


def write(out: Path, data: dict) -> None:
    """OUT rewritten whole (a reader never sees half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, out)


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    timeout_s = float(argv[argv.index("--timeout-s") + 1]) if "--timeout-s" in argv else RUN_TIMEOUT_S
    import torch

    if not torch.cuda.is_available():
        write(out, {"skipped": "no CUDA device"})
        return 0
    device = torch.cuda.get_device_name(0)
    gpu = hardware_for(device)
    if gpu is None:
        write(out, {"skipped": f"no hardware profile for {device!r} (fleetwise/calibrate/gpus.py)"})
        return 0
    gpus = torch.cuda.device_count()
    steps = QUICK_STEPS if "--quick" in argv else STEPS
    rows = bench(out, gpu.profile, gpus, steps, gpu.overrides(), timeout_s)
    write(
        out,
        {"device": device, "gpus": gpus, "profile": gpu.profile, "variant": gpu.variant, "rows": rows},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
