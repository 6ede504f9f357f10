"""GPU suite of scripts/bench.py: MFU of GPT recipes in bf16 on one GPU, torch.compile and
activation checkpointing on/off, and the planner's memory against torch.cuda.max_memory_allocated.

    python scripts/bench_gpu.py OUT.json [--quick]

Without CUDA it writes {"skipped": "no CUDA device"}. The peak for MFU is the bf16 matmul peak
`fleetwise calibrate` measures on this GPU (a dense bf16 GEMM), not the datasheet's.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

RECIPES = ("gpt/gpt2_small",)
BATCH, STEPS, WARMUP = 8, 8, 3


def measure(recipe: str, compile_: bool, recompute: str, peak: float) -> dict:
    from fleetwise.config.validate import load_config
    from fleetwise.plan import make_plan
    from fleetwise.runtime.modeling import build_model, build_source, model_spec
    from fleetwise.runtime.recompute import apply_recompute

    cfg = load_config([f"recipe={recipe}", "hardware=h100", "hardware.devices_per_node=1", "train.precision=bf16",
                       f"train.global_batch_size={BATCH}", f"train.micro_batch_size={BATCH}",
                       f"strategy.recompute={recompute}"])  # fmt: skip
    plan = make_plan(cfg)
    device = torch.device("cuda", 0)
    model = build_model(cfg).to(device)
    if recompute != "none":
        apply_recompute(model, recompute)
    spec = model_spec(cfg)
    step_model = torch.compile(model) if compile_ else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = {k: v.to(device) for k, v in build_source(cfg).batch(torch.arange(BATCH).numpy()).items()}
    times = []
    for step in range(STEPS):
        if step == WARMUP:
            torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = spec.loss(step_model(*[batch[k] for k in spec.inputs]), batch[spec.label])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[WARMUP:])
    measured = torch.cuda.max_memory_allocated(device)
    predicted = plan.memory_bytes["total"]
    del model, opt, step_model
    torch.cuda.empty_cache()
    return {
        "config": f"{recipe} bf16, compile {'on' if compile_ else 'off'}, recompute {recompute}",
        "step_s": step_s,
        "mfu": plan.flops_per_step / step_s / peak,
        "predicted_bytes": predicted,
        "measured_bytes": measured,
        "memory_error": predicted / measured - 1,
    }


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    if not torch.cuda.is_available():
        out.write_text(json.dumps({"skipped": "no CUDA device"}))
        return 0
    from fleetwise.launcher.calibrate import gemm_flops

    peak = max(gemm_flops(n, torch.device("cuda", 0), torch.bfloat16) for n in (4096, 8192))
    variants = (
        [(False, "none"), (True, "none")]
        if "--quick" in argv
        else [(c, r) for c in (False, True) for r in ("none", "full")]
    )
    rows = [measure(recipe, c, r, peak) for recipe in RECIPES for c, r in variants]
    out.write_text(
        json.dumps({"device": torch.cuda.get_device_name(0), "peak_bf16_tflops": peak / 1e12, "rows": rows})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
