"""Pipeline bubble of real torch.distributed.pipelining schedules (one torchrun job per pp degree).

    torchrun --nproc-per-node=PP scripts/bench_pipeline.py OUT.json [--microbatches 2,4,8] [--steps 4]

Each rank builds fleetwise's GPT, keeps its pipeline chunks (fleetwise.models.pipeline.pipeline_chunk, the
runtime's placement) and runs GPipe, 1F1B and interleaved 1F1B (2 chunks per rank) for several
micro-batch counts, a few steps each after warm-up.

Measured bubble of a step = 1 - busy / wall, averaged over ranks, where wall is the step's time
from a common barrier to the last rank's end, and busy is the time the rank's main thread was
running or runnable (on-CPU + run-queue wait, from /proc/thread-self/schedstat). A rank blocked
in a receive is neither: that is the bubble. Counting run-queue wait as busy keeps the measure
meaningful when ranks outnumber cores (pp=4 on 2 cores): a rank waiting for a core is not idle
by the schedule's fault. What time-sharing still distorts: a rank blocked because its neighbour
is waiting for a core counts that as bubble.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fleetwise.families.gpt.model import GPT
from fleetwise.families.gpt.schema import GPTModel
from fleetwise.models.pipeline import pipeline_chunk
from fleetwise.models.transformer import lm_loss
from fleetwise.plan.pipeline import bubble_fraction, split_layers

MODEL = dict(
    family="gpt",
    num_layers=8,
    hidden_size=128,
    num_attention_heads=4,
    ffn_hidden_size=512,
    vocab_size=256,
    seq_len=64,
)
MICRO_BATCH = 4


def busy_s() -> float:
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return (int(on_cpu) + int(waiting)) / 1e9


def run(schedule: str, pp: int, n: int, steps: int, warmup: int) -> dict:
    from torch.distributed import pipelining as P

    rank = dist.get_rank()
    v = 2 if schedule == "interleaved_1F1B" else 1
    chunks = pp * v
    torch.manual_seed(0)
    model = GPT(GPTModel(**MODEL))
    counts = split_layers(MODEL["num_layers"], chunks)
    starts = [sum(counts[:c]) for c in range(chunks)]
    mine = [c for c in range(chunks) if c % pp == rank]
    stages = [
        P.PipelineStage(
            pipeline_chunk(model, list(range(starts[c], starts[c] + counts[c])), c == 0, c == chunks - 1),
            c,
            chunks,
            torch.device("cpu"),
        )
        for c in mine
    ]
    cls = {"GPipe": P.ScheduleGPipe, "1F1B": P.Schedule1F1B, "interleaved_1F1B": P.ScheduleInterleaved1F1B}
    sched = cls[schedule](stages if v > 1 else stages[0], n_microbatches=n, loss_fn=lm_loss, scale_grads=True)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, MODEL["vocab_size"], (n * MICRO_BATCH, MODEL["seq_len"]), generator=gen)
    inputs = (tokens,) if 0 in mine else ()
    targets = {"target": tokens, "losses": []} if chunks - 1 in mine else {}
    walls, busies = [], []
    for step in range(warmup + steps):
        dist.barrier()
        start, b0 = time.perf_counter(), busy_s()
        sched.step(*inputs, **targets)
        busy, end = busy_s() - b0, time.perf_counter()
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)
        row = torch.tensor([end - start, busy], dtype=torch.float64)
        rows = [torch.zeros_like(row) for _ in range(pp)]
        dist.all_gather(rows, row)
        if step >= warmup:
            wall = max(float(r[0]) for r in rows)
            walls.append(wall)
            busies.append([float(r[1]) for r in rows])
    bubbles = [1 - statistics.fmean(b) / w for b, w in zip(busies, walls, strict=True)]
    return {
        "schedule": schedule,
        "pp": pp,
        "virtual_stages": v,
        "microbatches": n,
        "step_time_s": statistics.median(walls),
        "busy_s_per_rank": [statistics.median(col) for col in zip(*busies, strict=True)],
        "measured": statistics.median(bubbles),
        "measured_min": min(bubbles),
        "measured_max": max(bubbles),
        "predicted": bubble_fraction(schedule, pp, v, n),
    }


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--microbatches", default="")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pp = dist.get_world_size()
    counts = [int(x) for x in args.microbatches.split(",")] if args.microbatches else [pp, 2 * pp, 4 * pp]
    rows = []
    for schedule in ("GPipe", "1F1B", "interleaved_1F1B"):
        for n in counts:
            rows.append(run(schedule, pp, n, args.steps, args.warmup))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
