"""The baseline of the overhead benchmark: a minimal hand-written PyTorch training loop.

    python scripts/bench_plain_loop.py CONFIG.yaml OUT.json             # one process
    torchrun --nproc-per-node=2 scripts/bench_plain_loop.py CONFIG OUT  # DDP on gloo

It trains what `fleetwise train` trains from the same resolved config: the same model and data
code (fleetwise.models / fleetwise.data), the same optimizer (AdamW or SGD, decay on matrices
only), warm-up + cosine schedule, gradient clipping and micro-batch accumulation (DDP no_sync
until the last micro-batch). Everything else is plain torch: no mesh, no metrics per step.

Timer boundaries are the trainer's: a step starts before its batch is read and ends after
zero_grad; the per-step time of the job is the slowest rank's (gathered once, at the end).
`time` is each step's end on rank 0, so intervals between steps include everything the loop does.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from fleetwise.config.run import RunConfig
from fleetwise.data.loader import StepBatches
from fleetwise.rundir import Metric
from fleetwise.runtime.modeling import build_model, build_source, model_spec


def main(config: str, out: str) -> int:
    cfg = RunConfig.model_validate(yaml.safe_load(Path(config).read_text()))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    t, o = cfg.train, cfg.optim
    model = build_model(cfg)
    spec = model_spec(cfg)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    if o.name == "adamw":
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)
    else:
        opt = torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)

    def lr_lambda(done: int) -> float:
        if done < o.warmup_steps:
            return (done + 1) / o.warmup_steps
        progress = min(1.0, (done - o.warmup_steps) / max(1, t.steps - o.warmup_steps))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    n = t.global_batch_size // (t.micro_batch_size * world)
    data = StepBatches(build_source(cfg), t.global_batch_size, t.micro_batch_size, n, rank, world)

    step_s, ends, losses = [], [], []
    for step in range(1, t.steps + 1):
        start = time.perf_counter()
        micro = data.microbatches(step)
        total = 0.0
        for i, mb in enumerate(micro):
            sync = world == 1 or i == n - 1
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                loss = spec.loss(model(*[mb[k] for k in spec.inputs]), mb[spec.label])
                (loss / n).backward()
            total += loss.item()
        if o.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - start)
        ends.append(time.time())
        losses.append(total / n)

    times = torch.tensor(step_s, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
    if rank == 0:
        records = [
            {"step": i + 1, "time": ends[i], Metric.STEP_TIME: float(times[i]), Metric.LOSS: losses[i]}
            for i in range(t.steps)
        ]
        Path(out).write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return 0


if __name__ == "__main__":
    from fleetwise.runtime.mesh import exit_finished

    # like fleetwise's worker: a finished process must not abort in the interpreter's teardown
    exit_finished(main(*sys.argv[1:3]))
