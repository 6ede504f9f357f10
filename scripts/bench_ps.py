"""Parameter server, sync vs async, side by side: samples/s with and without a slowed trainer.

    .venv/bin/python scripts/bench_ps.py [--steps 60] [--repeats 2] [--slow 0.05] [OVERRIDES...]

Runs recipe=ctr/tiny (2 servers × 2 trainers unless overridden) in four variants, interleaved
`--repeats` times so that load from other processes hits all of them alike, and prints medians:
- samples/s: each trainer's own rate over its training loop, summed (the job's throughput; in
  async mode a slowed trainer lowers only its own share);
- fast trainer: trainer 0's rate (in sync mode every trainer goes at the slowest one's pace);
- step time: mean over steps after train.warmup_steps_excluded (slowest trainer per step);
- sparse pulled/step: bytes of sparse rows one trainer prefetches per step vs the full tables;
- init_rpc: on the rank that joined last (init_rpc itself) and the most any rank waited in it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleetwise.config.validate import load_config
from fleetwise.rundir import PS_SUMMARY_FILE


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--slow", type=float, default=0.05, help="seconds trainer 1 sleeps per step when slowed")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    variants = [
        ("sync", "sync", ""),
        ("async", "async", ""),
        ("sync, trainer 1 slowed", "sync", f"1:{args.slow}"),
        ("async, trainer 1 slowed", "async", f"1:{args.slow}"),
    ]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, mode, slow in variants:
                overrides = ["recipe=ctr/tiny", f"strategy.mode={mode}", f"train.steps={args.steps}"]
                overrides += [*args.overrides, "tracking.enabled=false"]
                cfg = load_config(overrides)
                run_dir = Path(tmp) / f"{r}-{mode}-{bool(slow)}"
                started = time.perf_counter()
                run = subprocess.run(
                    [
                        str(Path(sys.executable).parent / "fleetwise"),
                        "train",
                        *overrides,
                        f"run.dir={run_dir}",
                    ],
                    env={**os.environ, "FLEETWISE_PS_SLOW": slow},
                    capture_output=True,
                    text=True,
                )
                if run.returncode:
                    print((run.stdout + run.stderr)[-3000:], file=sys.stderr)
                    return 1
                summary = json.loads((run_dir / PS_SUMMARY_FILE).read_text())
                summary["wall_s"] = time.perf_counter() - started
                results[name].append(summary)
                print(f"  {name}: {summary['samples_per_s']:.0f} samples/s", file=sys.stderr, flush=True)
    t = cfg.strategy.num_trainers  # type: ignore[union-attr]
    print(
        f"recipe=ctr/tiny {' '.join(args.overrides)} · {cfg.strategy.num_trainers} trainers × "  # type: ignore[union-attr]
        f"{cfg.strategy.num_servers} servers · {args.steps} steps · median of {args.repeats}"  # type: ignore[union-attr]
    )
    header = f"{'variant':26s} {'samples/s':>10s} {'fast trainer':>13s} {'step ms':>8s} {'pull ms':>8s} {'push ms':>8s} {'wait ms':>8s}"
    print(header)
    for name, _, _ in variants:

        def med(f, rs=results[name]) -> float:
            return statistics.median(f(x) for x in rs)

        print(
            f"{name:26s} {med(lambda x: x['samples_per_s']):10.0f} "
            f"{med(lambda x: x['trainers'][0]['samples_per_s']):13.0f} "
            f"{med(lambda x: x['steady']['step_time_s_mean']) * 1e3:8.1f} "
            f"{med(lambda x: x['steady']['pull_latency_s_mean']) * 1e3:8.2f} "
            f"{med(lambda x: x['steady']['push_latency_s_mean']) * 1e3:8.2f} "
            f"{med(lambda x: x['steady']['wait_s_mean']) * 1e3:8.2f}"
        )
    any_run = results["sync"][0]
    pulled = statistics.median(x["sparse_bytes_pulled_per_step_mean"] for x in results["sync"]) / t
    print(
        f"sparse rows pulled per trainer per step: {pulled:,.0f} B of {any_run['sparse_table_bytes']:,} B "
        f"in the distributed tables ({pulled / any_run['sparse_table_bytes']:.2%})"
    )
    lo = [x["init_rpc_s_min"] for rs in results.values() for x in rs]
    hi = [x["init_rpc_s_max"] for rs in results.values() for x in rs]
    print(
        f"init_rpc: {statistics.median(lo):.2f} s on the last rank to arrive (median), "
        f"up to {statistics.median(hi):.2f} s on ranks that waited for it"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
