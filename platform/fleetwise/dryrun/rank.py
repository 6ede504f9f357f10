"""The dry run's rank side: run the real per-rank runtime (mesh, parallelize, optimizer, train
step) of one rank of a job of any size, without the memory, the compute or the other ranks.

`simulate_rank(cfg, plan, rank, steps)` puts the pieces of the package around the unchanged
`Trainer`: the fake world and fake tensors (dryrun/fake.py), the counters of FLOPs, collective
bytes and host reads (dryrun/counters.py), the live-tensor peak from the same tracker the real run
uses (`runtime.memory.LiveTensorBytes`, through `Trainer.memory`), micro-batches and alike blocks
sampled at two small counts and scaled (dryrun/sampling.py), the torch patches all of this needs
(dryrun/patches.py); it returns a JSON-able report. `main` is the entry point of one rank process,
started by `fleetwise dryrun` (dryrun/parent.py).

Fake `cuda` tensors cannot be created on a CPU build, so a GPU job is simulated on the cpu device:
bytes are the tensors' own, without the CUDA caching allocator's rounding.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from fleetwise import compat
from fleetwise.config.engine import Engine
from fleetwise.dryrun import patches
from fleetwise.dryrun.counters import Counters, mesh_group_labels, state_bytes
from fleetwise.dryrun.fake import FakeExecution, MetaRelay, init_fake_world
from fleetwise.dryrun.sampling import (
    SET_ASIDE,
    affine,
    in_flight,
    one_mesh,
    sampled_counts,
    sampled_layers,
    sampled_steps,
    use_microbatches,
    with_layers,
)


class _MetadataSent(Exception):
    """A neighbour-only stage has sent its pipeline metadata: its work is done."""


def _hook_initialization(trainer, counters_of, helper: bool) -> None:
    """Pipelining initializes its stages on the first step (P2P warm-up vote, a metadata forward
    and backward, messages to the neighbours): once per job, not per step, so not counted. A
    helper (a stage simulated only so its neighbours learn their shapes) stops right after."""
    schedule = trainer.model.schedule
    if schedule is None:
        return

    def wrap(original):
        def initialize(*args, **kwargs):
            counters = counters_of()
            counters.paused = True
            try:
                out = original(*args, **kwargs)
            finally:
                counters.paused = False
            if helper:
                raise _MetadataSent
            return out

        return initialize

    patches.wrap_stage_initialization(schedule, wrap)



# ------------------------------------------------------------------------------------------------
# Offload. A GPU job with `strategy.offload` (FSDP's CPUOffloadPolicy) keeps its sharded parameters,
# their gradients and the optimizer state -- and so the optimizer step -- in host RAM; the device
# holds only what FSDP gathers and computes. The dry run simulates every tensor on its one cpu
# device, where FSDP's host<->device copies (`.to(device)` of a shard before its all-gather,
# `.to("cpu")` of a reduce-scatter's output) are no-ops: without the following, the offloaded state
# was counted as device memory (GPT-3 1.3B ZeRO-3 + offload on h100: 4.00 GiB, the same as without
# offload, planned 1.35 GiB). The live-tensor tracker keeps host storages apart (runtime/memory.py
# LiveTensorBytes `host`): the state is host from the start of each step, and here the two copies
# are made what a GPU makes of them. Only for a GPU job: on a CPU device, host and device are one
# memory (the planner says so too), and the real runs never take this path.


def _live_tracker():
    """The live-tensor tracker that keeps host memory apart, or None."""
    from fleetwise.runtime.memory import LiveTensorBytes

    return next(
        (m for m in compat.dispatch_modes() if isinstance(m, LiveTensorBytes) and m.separate_host),
        None,
    )


def _offload_on_the_host(trainer, cfg) -> bool:
    """Count the host-resident state of a GPU job with offload as host memory (see above)."""
    if not (cfg.strategy.offload and cfg.hardware.device_type == "cuda" and trainer.model.engine == Engine.FSDP):
        return False
    patches.fsdp_copies_cross_to_the_host(_live_tracker)

    def host_state() -> list[torch.Tensor]:
        params = patches.offloaded_fsdp_params(trainer.model.parts)
        states = [opt.state.get(fp.sharded_param, {}) for fp in params for opt in trainer.optimizers.local()]
        return (
            [patches.sharded_data(fp) for fp in params]
            + [fp.sharded_param for fp in params]
            + [fp.sharded_param.grad for fp in params if fp.sharded_param.grad is not None]
            + [v for st in states for v in st.values() if torch.is_tensor(v)]
        )

    trainer.memory.host_state = host_state
    return True




def _peak_of_forward_backward(trainer) -> list[dict[str, int]]:
    """The live-tensor peaks of each step's forward and backward (all micro-batches), appended to
    the returned list at its end, by moment: under a pipeline schedule each stage's forward,
    backward and weight steps (the action running; "" before the first), else one. The tracker
    then restarts from the bytes live, so that the step's own peak is that of the rest (gradient
    reduction, norm, optimizer). Layer sampling scales each moment on its own (see above)."""
    from fleetwise.runtime.memory import LiveTensorBytes

    def tracker() -> LiveTensorBytes:
        return next(m for m in compat.dispatch_modes() if isinstance(m, LiveTensorBytes))

    marks: list[dict[str, int]] = []
    original = trainer.forward_backward

    def forward_backward(step: int):
        t = tracker()
        t.moment, t.moment_peaks = "", {"": t.current}
        out = original(step)
        marks.append(dict(t.moment_peaks))
        t.moment, t.peak = None, t.current
        return out

    def labelled(method, moment: str):
        def run(*args, **kwargs):
            t = tracker()
            if t.moment is not None:
                t.moment = moment
            return method(*args, **kwargs)

        return run

    trainer.forward_backward = forward_backward
    if trainer.model.schedule is not None:
        for stage in trainer.model.stages:
            for name, kind in (
                ("forward_one_chunk", "F"),
                ("backward_one_chunk", "B"),
                ("backward_weight_one_chunk", "W"),
            ):
                setattr(stage, name, labelled(getattr(stage, name), f"{stage.stage_index}{kind}"))
    return marks


def _run_trainer(
    cfg, plan, rank: int, env, fx, run_dir, steps: int, helper: bool, sample: bool
) -> dict[str, Any]:
    """Build the Trainer of `cfg` for this rank and run its steps (micro-batches sampled when
    `sample`): the per-step counts, the peak and the state bytes after the last step, scaled to the
    job's micro-batch count. None for a helper (it stops once its stage metadata is sent)."""
    import sys

    from fleetwise.runtime.trainer import Trainer

    started = time.perf_counter()
    SET_ASIDE.clear()  # keyed by id(): a previous trainer's receive-buffer dicts are gone
    trainer = Trainer(cfg, plan, env, run_dir, allocate=fx.allocate(env.device))
    built = time.perf_counter()
    labels = mesh_group_labels(trainer.mesh, trainer.model.expert_mesh)
    n = cfg.train.accumulate_steps
    ddp = trainer.model.engine == Engine.DDP
    counts = sampled_counts(trainer, n, steps, ddp) if sample and not helper else None
    full_schedule = trainer.model.schedule
    per_step = [n] * steps if counts is None else sampled_steps(counts, ddp)
    trainer.memory.samples = len(per_step)  # the live-tensor tracker of the real run, every step
    host = _offload_on_the_host(trainer, cfg)
    current: list[Counters] = []
    _hook_initialization(trainer, lambda: current[-1], helper)
    results, peaks, phases, host_peaks = [], [], [], []
    forward_backward_peaks = _peak_of_forward_backward(trainer)
    layers = len(trainer.model.parts[0].layers) if hasattr(trainer.model.parts[0], "layers") else None
    for step, k in enumerate(per_step, start=1):
        if counts is not None:
            use_microbatches(trainer, full_schedule, k)
        trainer.memory.peak = trainer.memory.host_peak = 0  # each step's own peak
        counters = Counters(labels)
        current.append(counters)
        try:
            with fx, counters:
                trainer.train_step(step)
        except _MetadataSent:
            return None
        results.append(counters.snapshot())
        # the step's peak: the larger of its forward-backward's moments' and the rest's (the
        # tracker restarts)
        phases.append({**forward_backward_peaks[-1], "rest of the step": trainer.memory.peak})
        peaks.append(max(phases[-1].values()))
        host_peaks.append(trainer.memory.host_peak)
        print(
            f"dryrun: rank {rank} step {step}/{len(per_step)} ({k} micro-batches"
            f"{'' if layers is None else f', {layers} blocks a chunk'}) {time.perf_counter() - built:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    state = state_bytes(trainer, trainer.memory.host_state() if host else ())
    peak, last, host_peak = max(peaks), results[-1], max(host_peaks)
    phase_peaks = {k: max(p.get(k, 0) for p in phases) for k in set().union(*phases)}
    if counts is not None:
        (na, nb), at_na, at_nb = counts, results[-2], results[-1]
        last = affine(at_na, at_nb, na, nb, n)
        peak = affine(peaks[-2], peaks[-1], na, nb, n)
        rest = "rest of the step"
        fb = [max(v for k, v in p.items() if k != rest) for p in phases]
        if ddp and steps >= 2:  # the second step's bucket rebuild (sampling.py), grown to n as the
            # forward-backward grows (the input batch), not as the step's peak (the optimizer's)
            peak = max(peak, fb[1] + (n - nb) * (fb[-1] - fb[-2]) / (nb - na))
        host_peak = affine(host_peaks[-2], host_peaks[-1], na, nb, n)
        # the rest of the step scaled on its own; every moment of the forward-backward grows in the
        # micro-batch count as the forward-backward's peak does (what grows with it -- held sends,
        # activations in flight -- is the step's, not a moment's): a moment scaled on its own from
        # two small counts can reach, at the first of them, state later rounds hold (GPT-3 13B zero
        # bubble v 2, rank 8, 256 micro-batches read 114 GiB where every micro-batch run reads 19)
        grown = affine(fb[-2], fb[-1], na, nb, n) - fb[-1]
        phase_peaks = {k: v + grown for k, v in phases[-1].items() if k != rest}
        phase_peaks[rest] = affine(phases[-2][rest], phases[-1][rest], na, nb, n)
    return {
        "counts": last,
        "peak": peak,
        "phase_peaks": phase_peaks,
        "host_peak": host_peak,
        "state": state,
        "reads": results[-1]["reads"],
        "coords": trainer.coords,
        "chunks": trainer.model.chunk_ids,
        "per_step": per_step,
        "scaled": counts is not None,
        "in_flight": {str(k): v for k, v in in_flight(full_schedule, trainer.coords["pp"]).items()}
        if full_schedule is not None
        else None,
        "time_s": {"build": built - started, "steps": time.perf_counter() - built},
    }


def simulate_rank(
    cfg, plan, rank: int, steps: int = 2, run_dir=None, *, helper: bool = False, sample: bool = True
) -> dict[str, Any]:
    """Run `steps` optimizer steps of rank `rank` of the job `cfg` (any world size) under fake
    tensors and the fake backend, in this process, with the real Trainer. Returns the report.
    run_dir: a folder shared by the ranks simulated together (the pipeline metadata relay).
    helper: a pipeline neighbour of a selected rank: build, send the stage metadata, stop.
    sample: simulate two small micro-batch counts and, where the blocks are alike, two small block
    counts, and scale (see above) when that is cheaper."""
    import tempfile
    from pathlib import Path

    from fleetwise import rundir
    from fleetwise.config.layout import Layout
    from fleetwise.runtime.mesh import DistEnv

    started = time.perf_counter()
    world = cfg.hardware.world_size
    init_fake_world(rank, world, cfg.hardware.backend)
    device = torch.device("cpu")  # fake cuda needs a CUDA build of torch: see the module's note
    env = DistEnv(rank, world, 0, device, 0)
    fx = FakeExecution()
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="fleetwise-dryrun-"))
    relay = None
    if Layout.of(cfg).pp > 1:
        relay = MetaRelay(run_dir / rundir.PIPELINE_META_DIR)
        relay.install()
    sampling = sampled_layers(cfg, rank) if sample and not helper else None
    layers, samples = sampling or (None, None)
    if layers is None:
        runs = [_run_trainer(cfg, plan, rank, env, fx, run_dir, steps, helper, sample)]
        if runs[0] is None:
            return {
                "rank": rank,
                "helper": True,
                "time_s": {"build": time.perf_counter() - started, "steps": 0.0},
            }
    else:
        one_mesh()
        runs = []
        for k in samples:
            if relay is not None:
                relay.rewind()  # the next trainer's stages exchange the same metadata again
            runs.append(
                _run_trainer(with_layers(cfg, k), plan, rank, env, fx, run_dir, steps, helper, sample)
            )
    run = runs[-1]
    last, peak, state, reads = run["counts"], run["peak"], run["state"], run["reads"]
    host_peak = run["host_peak"]
    if layers is not None:
        (la, lb), (a, b) = samples, runs
        last = affine(a["counts"], b["counts"], la, lb, layers)
        # each moment of the step scaled on its own: which one peaks may change with the block
        # count (the optimizer's at 1 block, the backward's from 2 on; interleaved zero bubble
        # under FSDP's mixed precision, full recompute: a step on the first chunk at 1 and 2
        # blocks, the last chunk's weight step from 3 on). Scaled as one from 1 and 2 blocks,
        # GPT-3 13B zero bubble v 2 read 105,101,568 B less than every block simulated
        pa, pb = a["phase_peaks"], b["phase_peaks"]
        peak = max(affine(pa[k], pb[k], la, lb, layers) for k in pa.keys() & pb)
        state = affine(a["state"], b["state"], la, lb, layers)
        host_peak = affine(a["host_peak"], b["host_peak"], la, lb, layers)
        reads = int(round(affine(a["reads"], b["reads"], la, lb, layers)))
    state = {k: int(round(v)) for k, v in state.items()}
    host = {k.removeprefix("host_"): state.pop(k) for k in [k for k in state if k.startswith("host_")]}
    peak = int(round(peak))
    state_total = sum(state.values())
    # a GPU job's offloaded state (see "Offload" above): in host RAM, beside the device's peak
    host_memory = {**host, "peak": int(round(host_peak))} if host else None
    return {
        "rank": rank,
        "coords": run["coords"],
        "chunks": run["chunks"],
        "memory_bytes": {**state, "activations_and_temporaries": max(peak - state_total, 0), "peak": peak},
        "host_memory_bytes": host_memory,
        "flops_per_step": int(round(last["flops"])),
        "comm_bytes_per_step": {g: int(round(sum(ops.values()))) for g, ops in last["bytes"].items()},
        "comm_by_op": {g: {k: int(round(v)) for k, v in ops.items()} for g, ops in last["bytes"].items()},
        "comm_calls": {g: {k: int(round(v)) for k, v in ops.items()} for g, ops in last["calls"].items()},
        "host_reads": reads,
        "microbatches": {
            "job": cfg.train.accumulate_steps,
            "simulated": run["per_step"],
            "scaled": run["scaled"],
            "in_flight": run["in_flight"],
        },
        "layers": {
            "job": layers,
            "simulated": list(samples) if layers is not None else None,
            "scaled": layers is not None,
        },
        "time_s": {
            "build": sum(r["time_s"]["build"] for r in runs)
            + (time.perf_counter() - started)
            - sum(r["time_s"]["build"] + r["time_s"]["steps"] for r in runs),
            "steps": sum(r["time_s"]["steps"] for r in runs),
        },
        "pid": os.getpid(),
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m fleetwise.dryrun.rank RUN_DIR RANK STEPS [--helper] [--no-sample]`: simulate
    one rank of the job in RUN_DIR (config.yaml, plan.json, as `fleetwise train` writes them) and
    write RUN_DIR/dryrun/rank_RANK.json. Started by `fleetwise dryrun`, one process per rank."""
    import json
    import sys
    import warnings
    from pathlib import Path

    from fleetwise import rundir

    run_dir, rank, steps = Path(argv[0]), int(argv[1]), int(argv[2])
    helper, sample = "--helper" in argv[3:], "--no-sample" not in argv[3:]
    warnings.filterwarnings("ignore")  # torch's fake-backend and FSDP notices, once per rank
    compat.quiet_redistribute_logs()
    cfg, plan = rundir.read_config(run_dir), rundir.read_plan(run_dir)
    print(f"dryrun: rank {rank} started", file=sys.stderr, flush=True)
    report = simulate_rank(cfg, plan, rank, steps, run_dir=run_dir / "dryrun", helper=helper, sample=sample)
    out = run_dir / "dryrun" / f"rank_{rank}.json"
    out.write_text(json.dumps(report, indent=1))
    if helper:
        print(f"dryrun: rank {rank} sent its stage metadata", file=sys.stderr, flush=True)
        return 0
    t = report["time_s"]
    print(
        f"dryrun: rank {rank} done (build {t['build']:.1f} s, {steps} steps {t['steps']:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    import sys

    from fleetwise.runtime.mesh import exit_finished

    exit_finished(main(sys.argv[1:]))

