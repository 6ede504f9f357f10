"""`fleetwise dryrun`'s parent side: the real per-rank runtime of a job of any size, on fake tensors.

The config is validated exactly as `train` validates it (exit 2, nothing started). Then this
module picks the ranks to simulate and starts one process per rank, each running
`fleetwise.dryrun.rank.main`: the same mesh, parallelize, optimizer and train step that `train`
runs, under FakeTensorMode and the fake process group (see dryrun/rank.py). Each reports its peak
live-tensor bytes, FLOPs and collective bytes per step; this module puts the planner's figures
beside them. It imports no torch (the rank processes do).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from fleetwise import rundir
from fleetwise.config.layout import Layout
from fleetwise.plan.records import Plan

NOT_ALIKE = "pipeline stages are not alike"  # dryrun.fake.MetaRelay's message when a check fails
DIMS = ("dp", "sharding", "mp", "pp")


def rank_of(layout: Layout, coords: dict[str, int]) -> int:
    return layout.rank_of(coords)


def default_ranks(layout: Layout, alike: dict[str, Any] | None = None) -> list[int]:
    """One rank per distinct role: every pipeline stage (they differ in layers and ends, and must
    run together anyway, see `with_pipelines`), at the first and the last sharding coordinate (FSDP
    shards may be uneven). Ranks that differ only in dp or mp coordinates hold the same shapes.
    alike: `stand_ins(cfg)` -- the middle stages hold alike layers, so their shards are those of
    the stage of chunk 1: the stages of the first chunk, of chunk 1 and of the last chunk are the
    roles (a middle stage differs from chunk 1's only in the micro-batches it has in flight, fewer
    in 1F1B; `--ranks` names any other)."""
    shard_coords = sorted({0, layout.sharding - 1})
    stages = range(layout.pp) if alike is None else {alike["owners"][c] for c in (0, 1, -1)}
    return sorted({rank_of(layout, {"pp": p, "sharding": s}) for p in stages for s in shard_coords})


def with_pipelines(layout: Layout, ranks: list[int], stages: list[int] | None = None) -> list[int]:
    """The ranks plus the other pipeline ranks their stages learn their metadata from: a stage
    learns its input shapes from its neighbours before the first step (dryrun/fake.py MetaRelay).
    stages: the pipeline ranks that must run (`stand_ins`); by default all of them."""
    out = set()
    for r in ranks:
        c = layout.coords(r)
        out.update(rank_of(layout, {**c, "pp": p}) for p in (range(layout.pp) if stages is None else stages))
        out.add(r)
    return sorted(out)


def stand_ins(cfg) -> dict[str, Any] | None:
    """When a pipeline's middle chunks (all but the first and the last) hold alike layers, which
    chunks must run for every stage to learn its metadata, or None (all of them).

    A middle chunk maps its input metadata to its output metadata by its layers alone (the metadata
    hold local shapes, dtypes, strides and DTensor placements, and name no rank), so alike chunks
    are one function f. Chunk 1 runs and its input (chunk 0's output) must equal its output: then
    every middle chunk's input and output are that same metadata (f(M) = M, by induction along the
    pipeline), and a chunk that does not run is answered with chunk 1's real output. Backward, the
    same with chunk S-2 and the gradients it receives from chunk S-1. The relay checks both
    equalities when it answers (dryrun/fake.py MetaRelay); if one fails the dry run runs again
    with every chunk. "Alike" is decided on the planner's units (runtime and planner split layers
    with the same `split_layers`): every middle chunk the same list of units, names aside."""
    from dataclasses import replace

    from fleetwise.plan.chunks import assign_units
    from fleetwise.plan.pipeline import chunk_ranks

    layout = Layout.of(cfg)
    if layout.pp <= 1:
        return None
    s = cfg.strategy
    chunks = layout.pp * s.virtual_stages
    if chunks < 5:  # chunks 0, 1, S-2 and S-1 are all of them
        return None
    kinds = {tuple(repr(replace(u, name="")) for u in chunk) for chunk in assign_units(cfg, layout)[1:-1]}
    if len(kinds) != 1:
        return None
    owners = chunk_ranks(s.schedule, layout.pp, s.virtual_stages)
    return {
        "owners": owners,
        "forward": 1,
        "backward": chunks - 2,
        "pp_ranks": sorted({owners[c] for c in (0, 1, chunks - 2, chunks - 1)}),
    }


# Every rank process imports torch and the runtime (about 5 s each on an idle machine, 10 s under load):
# they are forked instead from one server process that imported them once (multiprocessing's
# forkserver: a clean process, no threads, nothing of the launcher's state).
PRELOAD = [
    "fleetwise.dryrun.parent",
    "fleetwise.dryrun.rank",  # with fleetwise.compat: torch's fake process-group backend
    "fleetwise.runtime.trainer",
    "torch.distributed.pipelining",
    "torch.utils.flop_counter",
]


def _rank_process(argv: list[str], log: str) -> None:
    """A rank process (forked from the server): `python -m fleetwise.dryrun.rank ARGV`, with
    its standard output and error in `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from fleetwise.dryrun.rank import main
    from fleetwise.runtime.mesh import exit_finished

    exit_finished(main(argv))


def _forkserver():
    import atexit
    import multiprocessing

    from fleetwise.runtime.lifeline import stop_fork_server

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # one server for every dry run of this process (a test session's too), ended with the process:
    # not left to tear torch down by itself after it
    atexit.unregister(stop_fork_server)
    atexit.register(stop_fork_server)
    return ctx


def parse_ranks(spec: str, world: int) -> list[int]:
    """'0,5,8-11' or 'all' -> sorted ranks; ValueError names what is wrong."""
    if spec == "all":
        return list(range(world))
    ranks: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        a, b = int(lo), int(hi or lo)
        if not (0 <= a <= b < world):
            raise ValueError(f"rank range {part!r} is outside 0..{world - 1}")
        ranks.update(range(a, b + 1))
    return sorted(ranks)


def simulate(
    cfg,
    plan,
    argv: list[str],
    ranks: list[int],
    steps: int,
    progress=print,
    workers: int | None = None,
    exact: bool = False,
    alike: bool = True,
) -> list[dict[str, Any]]:
    """Run the selected ranks, `workers` processes at a time; returns their reports by rank. The
    other stages of a selected rank's pipeline run as helpers: they build their stage and send its
    metadata to their neighbours, then stop (dryrun/fake.py MetaRelay).
    exact: simulate every micro-batch of a step instead of two small counts scaled (dryrun/sampling.py).
    alike: run only the pipeline ranks `stand_ins` names when the middle chunks are alike (False:
    every pipeline rank, as the shortcut is checked against)."""
    from fleetwise.rundir import write_run_dir

    layout = Layout.of(cfg)
    shortcut = stand_ins(cfg) if alike else None
    pp_ranks = None
    if shortcut is not None:  # the same pipeline ranks in every pipeline that runs: one relay plan
        pp_ranks = sorted({*shortcut["pp_ranks"], *(layout.coords(r)["pp"] for r in ranks)})
        if len(pp_ranks) == layout.pp:
            shortcut, pp_ranks = None, None
    helpers = sorted(set(with_pipelines(layout, ranks, pp_ranks)) - set(ranks))
    everyone = sorted({*ranks, *helpers})
    # pipeline stages wait for each other's metadata: all of them must be alive at once
    parallel = len(everyone) if layout.pp > 1 else min(len(everyone), os.cpu_count() or 1)
    workers = workers or max(1, parallel)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fleetwise-dryrun-") as tmp:
        run_dir = Path(tmp)
        write_run_dir(run_dir, cfg, plan, argv)
        (run_dir / "dryrun").mkdir()
        if shortcut is not None:
            owners = shortcut["owners"]
            plan_file = run_dir / "dryrun" / rundir.PIPELINE_META_DIR / rundir.STAND_INS_FILE
            plan_file.parent.mkdir()
            plan_file.write_text(json.dumps({
                "running": [c for c, owner in enumerate(owners) if owner in pp_ranks],
                "forward": shortcut["forward"],
                "backward": shortcut["backward"],
            }))  # fmt: skip
            skipped = layout.pp - len(pp_ranks)
            progress(f"pipeline ranks {', '.join(map(str, pp_ranks))} run; the {skipped} others' alike "
                     f"middle stages are answered from stages {shortcut['forward']} and {shortcut['backward']}")  # fmt: skip
        ctx = _forkserver()
        pending, running, failed, done, unlike = list(everyone), {}, [], 0, False
        beat = time.perf_counter()
        while pending or running:
            while pending and len(running) < workers:
                rank = pending.pop(0)
                log = rundir.rank_log(run_dir, rank)
                log.write_text("")
                argv = (
                    [str(run_dir), str(rank), str(steps)]
                    + ["--helper"] * (rank in helpers)
                    + ["--no-sample"] * exact
                )
                proc = ctx.Process(target=_rank_process, args=(argv, str(log)), daemon=True)
                proc.start()
                running[rank] = (proc, log)
                role = "pipeline neighbour" if rank in helpers else "simulated"
                progress(f"rank {rank}: started, {role} ({len(everyone) - len(pending)}/{len(everyone)})")
            time.sleep(0.2)
            if time.perf_counter() - beat > 15:
                beat = time.perf_counter()
                progress(f"{done}/{len(everyone)} done, {len(running)} running ({beat - started:.0f} s)")
            for rank, (proc, log) in list(running.items()):
                if proc.exitcode is None:
                    continue
                proc.join()
                del running[rank]
                done += 1
                if proc.exitcode:
                    lines = log.read_text().strip().splitlines()
                    failed.append(f"rank {rank} (exit {proc.exitcode}): {lines[-1] if lines else ''}")
                    unlike = unlike or any(NOT_ALIKE in line for line in lines[-5:])
                    pending.clear()
                    for other, _ in running.values():  # its pipeline peers would wait for it forever
                        other.kill()
                elif rank in helpers:
                    progress(f"rank {rank}: sent its stage metadata ({time.perf_counter() - started:.0f} s)")
                else:
                    rep = json.loads((run_dir / "dryrun" / f"rank_{rank}.json").read_text())
                    mb, lay = rep["microbatches"], rep.get("layers") or {}
                    scaled = (
                        f", {'+'.join(map(str, mb['simulated'][:2]))} of {mb['job']} micro-batches simulated, scaled"
                        if mb["scaled"]
                        else ""
                    )
                    if lay.get("scaled"):
                        scaled += (
                            f", {' and '.join(map(str, lay['simulated']))} of {lay['job']} blocks a chunk"
                        )
                    progress(
                        f"rank {rank}: peak {rep['memory_bytes']['peak'] / 2**30:.3f} GiB, "
                        f"{rep['flops_per_step'] / 1e12:.2f} TFLOP/step "
                        f"({rep['time_s']['build']:.1f} s build, {rep['time_s']['steps']:.1f} s steps{scaled})"
                    )
        if failed and unlike and shortcut is not None:
            progress(f"{failed[0]}: running every pipeline stage instead")
            return simulate(cfg, plan, argv, ranks, steps, progress, workers, exact, alike=False)
        if failed:
            raise RuntimeError("; ".join(failed))
        return [json.loads((run_dir / "dryrun" / f"rank_{r}.json").read_text()) for r in ranks]


def rel(a: float, b: float) -> float | None:
    """Relative difference of the planner's a from the dry run's b."""
    return (a - b) / b if b else (0.0 if a == 0 else None)


def compare(plan: Plan, report: dict[str, Any]) -> dict[str, Any]:
    """The planner's figures for this rank beside the dry run's, with relative differences."""
    stage = plan.stages[report["coords"]["pp"]] if plan.stages else {}
    planned_mem = stage.get("memory_total_bytes", plan.memory_bytes["total"])
    measured = report["comm_bytes_per_step"]
    comm = {}
    # flattened groups by the planner's dim: DDP over dp × cp counts as dp, FSDP over sharding × cp
    # as sharding (config/layout.py); every other group under its own name
    merged = {"dp+sharding": "dp", "dp+cp": "dp", "sharding+cp": "sharding"}
    planned = stage.get("comm_bytes_per_step", plan.comm_bytes_per_step)
    got: dict[str, int] = {}
    for group, n in measured.items():
        got[merged.get(group, group)] = got.get(merged.get(group, group), 0) + n
    # every group either side names, so that traffic the planner has no figure for (or a figure
    # the dry run saw no group for) shows, with "missing" naming the side without it
    for dim in (*DIMS, *sorted(set(planned) - set(DIMS)), *sorted(set(got) - set(planned) - set(DIMS))):
        want, seen = planned.get(dim, 0), got.get(dim, 0)
        comm[dim] = {"planner": want, "dryrun": seen, "rel": rel(want, seen)}
        if want and dim not in got or seen and dim not in planned:
            comm[dim]["missing"] = "dryrun" if dim not in got else "planner"
    flops = stage.get("flops_per_device", 0.0)
    out = {
        "memory_bytes": {"planner": planned_mem, "dryrun": report["memory_bytes"]["peak"]}
        | {"rel": rel(planned_mem, report["memory_bytes"]["peak"])},
        "flops_per_step": {"planner": flops, "dryrun": report["flops_per_step"]}
        | {"rel": rel(flops, report["flops_per_step"])},
        "comm_bytes_per_step": comm,
    }
    host = report.get("host_memory_bytes")
    if host:  # a GPU job's offloaded state, in host RAM
        planned_host = stage.get("host_memory_bytes", plan.memory_bytes.get("host", 0))
        out["host_memory_bytes"] = {"planner": planned_host, "dryrun": host["peak"]} | {
            "rel": rel(planned_host, host["peak"])
        }
    return out
