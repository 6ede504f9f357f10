"""GPU suite of scripts/bench.py: `fleetwise train` itself -- the trainer, its engines and its
metrics -- on one GPU and on all GPUs of the node, bf16 (fp16 where the GPU has no bf16), for
GPT-3 1.3B and ResNet-50. Per run: step time, MFU (against the profile's datasheet peak, as the
trainer reports it), tokens/s or samples/s, and the allocator's peak allocated and reserved bytes
against the plan's prediction and its usable memory.

    python scripts/bench_gpu.py OUT.json [--quick]

Without CUDA it writes {"skipped": "..."} and exits 0. Nothing here is tuned per GPU: the runs
use the recipes' layouts with a short batch, so the first session with a GPU measures all of it
in one command (and the planner's memory and time models meet real numbers).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from fleetwise import rundir
from fleetwise.rundir import Metric

WARMUP = 3  # leading steps left out (allocator warm-up, cuDNN/cuBLAS autotuning, NCCL set-up)
STEPS, QUICK_STEPS = 12, 6
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
PROFILES = {"H100": "h100", "A100": "a100", "V100": "v100"}


def profile_for(device_name: str) -> str | None:
    """The hardware profile of a GPU by its CUDA name ("NVIDIA H100 80GB HBM3" -> h100)."""
    return next((p for key, p in PROFILES.items() if key in device_name.upper()), None)


def precision_for(profile: str) -> str:
    """bf16, except on GPUs without native bf16 (V100), which train in fp16."""
    return "fp16" if profile == "v100" else "bf16"


def cases(profile: str, gpus: int, steps: int) -> list[tuple[str, list[str]]]:
    """(name, overrides) of every run: each model on 1 GPU and on all `gpus` of the node."""
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
                        f"hardware={profile}",
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
    }
    if Metric.TOKENS_PER_S in steady[0]:
        row["tokens_per_s"] = statistics.median(r[Metric.TOKENS_PER_S] for r in steady)
    return row


def run(name: str, overrides: list[str], out_dir: Path) -> dict:
    run_dir = out_dir / name
    exe = Path(sys.executable).parent / "fleetwise"
    r = subprocess.run([str(exe), "train", *overrides, f"run.dir={run_dir}"], capture_output=True, text=True)
    if r.returncode != 0:
        return {"name": name, "overrides": overrides, "error": (r.stderr or r.stdout)[-2000:]}
    records = [json.loads(x) for x in rundir.metrics_path(run_dir).read_text().splitlines() if x.strip()]
    plan = json.loads((run_dir / rundir.PLAN_FILE).read_text())
    return {"name": name, "overrides": overrides, **summarize(records, plan)}


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    import torch

    if not torch.cuda.is_available():
        out.write_text(json.dumps({"skipped": "no CUDA device"}))
        return 0
    device = torch.cuda.get_device_name(0)
    profile = profile_for(device)
    if profile is None:
        out.write_text(json.dumps({"skipped": f"no hardware profile for {device!r} (conf/hardware/)"}))
        return 0
    gpus = torch.cuda.device_count()
    steps = QUICK_STEPS if "--quick" in argv else STEPS
    runs_dir = out.with_suffix(".runs")
    rows = [run(name, overrides, runs_dir) for name, overrides in cases(profile, gpus, steps)]
    out.write_text(json.dumps({"device": device, "gpus": gpus, "profile": profile, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
