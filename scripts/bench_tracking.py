"""How fast metrics reach MLflow: RunTracker.poll() (batched log_batch) vs one call per value.

    .venv/bin/python scripts/bench_tracking.py [--steps 300] [--naive-steps 50] [--uri URI]

Both are measured in the same run against the same store and printed side by side as rates
(values per second), so the ratio holds on a loaded machine too. Default store: a fresh sqlite
store in a temp dir, what `fleetwise train` uses without MLFLOW_TRACKING_URI; pass --uri
http://127.0.0.1:5000 to measure a server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from fleetwise.rundir import metrics_path

METRICS = 12
PARAMS = 200


def write_steps(run_dir: Path, steps: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(metrics_path(run_dir), "w") as f:
        for step in range(1, steps + 1):
            record = {"step": step, "time": time.time()} | {
                f"bench/m{i}": step + i / 100 for i in range(METRICS)
            }
            f.write(json.dumps(record) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="steps shipped by poll() (12 metrics each)")
    p.add_argument("--naive-steps", type=int, default=50, help="steps logged one value per call")
    p.add_argument("--uri", help="tracking URI (default: a fresh sqlite store in a temp dir)")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="fleetwise-bench-"))
    os.environ["MLFLOW_TRACKING_URI"] = args.uri or f"sqlite:///{tmp}/mlflow.db"
    from fleetwise.tracking.run_tracker import RunTracker
    from fleetwise.tracking.store import client, tracking_uri

    mlflow_client = client(tracking_uri())
    mlflow_client.search_experiments()  # create the store's tables outside the timings
    params = {f"group{i // 20}": {f"key{i}": i} for i in range(PARAMS)}

    # batched: what the launcher does
    run_dir = tmp / "batched"
    tracker = RunTracker(
        run_dir,
        experiment="bench",
        run_name="batched",
        params=params,
        tags={},
        artifacts=[],
        system_metrics=False,
    )
    began = time.perf_counter()
    tracker.start()
    t_params_batched = time.perf_counter() - began
    write_steps(run_dir, args.steps)
    began = time.perf_counter()
    delivered = 0
    while n := tracker.poll(max_batches=1000):
        delivered += n
    t_batched = time.perf_counter() - began
    tracker.finish("FINISHED")
    assert delivered == args.steps, delivered

    # naive: one call per param and per metric value
    experiment_id = mlflow_client.get_experiment_by_name("bench").experiment_id
    run_id = mlflow_client.create_run(experiment_id, run_name="naive").info.run_id
    flat = [(f"group{i // 20}.key{i}", str(i)) for i in range(PARAMS)]
    began = time.perf_counter()
    for key, val in flat:
        mlflow_client.log_param(run_id, key, val)
    t_params_naive = time.perf_counter() - began
    began = time.perf_counter()
    for step in range(1, args.naive_steps + 1):
        for i in range(METRICS):
            mlflow_client.log_metric(run_id, f"bench/m{i}", step + i / 100, step=step)
    t_naive = time.perf_counter() - began
    mlflow_client.set_terminated(run_id)
    if not args.uri:
        shutil.rmtree(tmp, ignore_errors=True)

    rate_batched = args.steps * METRICS / t_batched
    rate_naive = args.naive_steps * METRICS / t_naive
    print(f"store: {tracking_uri()}")
    print(
        f"params  {PARAMS}: batched {t_params_batched:.2f} s (run creation included) | "
        f"one call each {t_params_naive:.2f} s  -> {t_params_naive / t_params_batched:.0f}x"
    )
    print(
        f"metrics batched (poll): {args.steps} steps x {METRICS} in {t_batched:.2f} s = {rate_batched:,.0f} values/s | "
        f"one call each: {args.naive_steps} steps x {METRICS} in {t_naive:.2f} s = {rate_naive:,.0f} values/s "
        f"-> {rate_batched / rate_naive:.0f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
