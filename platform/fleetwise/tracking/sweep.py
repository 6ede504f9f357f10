"""Hydra multirun → one MLflow parent run with one child run per sweep point.

Registered in conf/config.yaml:

    hydra:
      callbacks:
        mlflow_sweep:
          _target_: fleetwise.tracking.sweep.MlflowSweepCallback

`on_multirun_start` creates the parent run and writes its id to <sweep_dir>/parent_run_id; each
job reads it back (`parent_run_id_for`, or `parent_run_id_from_hydra` inside a job) and passes it to
RunTracker, which tags its run `mlflow.parentRunId`. `on_multirun_end` compares the children (table
and PNG, written to the sweep dir and logged on the parent) and ends the parent run.

The callback must never break a sweep: if MLflow is unreachable it says so once and the jobs log
standalone runs. mlflow is imported only when a multirun starts.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from fleetwise.tracking.compare import (
    SWEEP_PARENT_TAG,
    add_loss_curves,
    child_runs,
    markdown_table,
    row_from_run,
    write_chart,
)
from fleetwise.tracking.params import param_value
from fleetwise.tracking.store import clean_key, client, describe, ensure_experiment, tracking_uri

PARENT_ID_FILE = "parent_run_id"
PARENT_INFO_FILE = "parent_run.json"
COMPARE_PNG = "compare.png"
COMPARE_MD = "compare.md"


def parent_run_id_for(sweep_dir: Path) -> str | None:
    """The parent run id written by MlflowSweepCallback for this sweep dir, or None."""
    try:
        run_id = (Path(sweep_dir) / PARENT_ID_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return run_id or None


def parent_run_id_from_hydra() -> str | None:
    """Inside a Hydra job: the sweep's parent run id when the job is part of a multirun, else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    return parent_run_id_for(Path(hc.sweep.dir))


class MlflowSweepCallback(Callback):
    def __init__(self, experiment: str | None = None) -> None:
        self.experiment = experiment  # default: the config's tracking.experiment
        self._parent: dict[str, str] | None = None  # run_id, tracking_uri, sweep_dir
        self._failed_jobs = 0

    # Hydra hooks ---------------------------------------------------------------------------------

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        tracking = config.get("tracking") or {}
        if not tracking.get("enabled", True):
            return
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        experiment = self.experiment or tracking.get("experiment") or "fleetwise"
        uri = tracking_uri()
        try:
            mlflow_client = client(uri)
            experiment_id = ensure_experiment(mlflow_client, experiment, uri)
            overrides = [str(o) for o in config.hydra.overrides.task]
            run = mlflow_client.create_run(
                experiment_id,
                run_name=f"sweep-{sweep_dir.parent.name}-{sweep_dir.name}",
                tags={
                    SWEEP_PARENT_TAG: "parent",
                    "fleetwise.sweep_dir": str(sweep_dir),
                    "fleetwise.sweep_overrides": " ".join(overrides)[:5000],
                    "mlflow.source.name": "fleetwise train -m",
                    "mlflow.source.type": "LOCAL",
                },
            )
            run_id = run.info.run_id
            # The swept keys as params (`sweep.strategy` = `dp,sharding,hybrid`), for the UI's table.
            for item in overrides:
                key, sep, value = item.partition("=")
                if sep:
                    mlflow_client.log_param(
                        run_id, clean_key("sweep." + key.lstrip("+~")), param_value(value)
                    )
        except Exception as exc:
            _warn(f"MLflow at {uri} is unreachable ({describe(exc)}); the sweep's jobs log standalone runs")
            return
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / PARENT_ID_FILE).write_text(run_id + "\n")
        (sweep_dir / PARENT_INFO_FILE).write_text(
            json.dumps({"run_id": run_id, "tracking_uri": uri, "experiment": experiment}, indent=1)
        )
        self._parent = {"run_id": run_id, "tracking_uri": uri, "sweep_dir": str(sweep_dir)}
        # A sweep stopped by a failing job or Ctrl-C never reaches on_multirun_end: end it anyway.
        atexit.register(self._end_at_exit)

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        if getattr(getattr(job_return, "status", None), "name", "") == "FAILED":
            self._failed_jobs += 1

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self._end(complete=True)

    # ending the parent ---------------------------------------------------------------------------

    def _end_at_exit(self) -> None:
        self._end(complete=False)

    def _end(self, *, complete: bool) -> None:
        parent, self._parent = self._parent, None
        if parent is None:
            return
        with contextlib.suppress(Exception):
            atexit.unregister(self._end_at_exit)
        try:
            self.end_parent(
                parent["run_id"], parent["tracking_uri"], Path(parent["sweep_dir"]), complete=complete
            )
        except Exception as exc:
            _warn(f"could not finish the sweep's parent run {parent['run_id']}: {describe(exc)}")

    def end_parent(self, run_id: str, uri: str, sweep_dir: Path, *, complete: bool) -> str:
        """Compare the children, attach table and chart to the parent, set its status; returns it.

        FINISHED when every child finished; FAILED when a child or a job failed; KILLED when the
        sweep stopped early without a failure."""
        mlflow_client = client(uri)
        parent = mlflow_client.get_run(run_id)
        children = child_runs(mlflow_client, parent)
        rows = add_loss_curves(mlflow_client, [row_from_run(child) for child in children])
        # A job can fail before its run exists, and a failed run is usually a failed job: count
        # whichever view sees more, never both.
        failed = max(self._failed_jobs, sum(row.status in ("FAILED", "KILLED") for row in rows))
        if failed:
            status = "FAILED"
        elif complete and all(row.status == "FINISHED" for row in rows):
            status = "FINISHED"
        else:
            status = "KILLED"
        if rows:
            title = f"sweep {sweep_dir.parent.name}/{sweep_dir.name}: {len(rows)} runs"
            chart = write_chart(rows, sweep_dir / COMPARE_PNG, title=title)
            table = sweep_dir / COMPARE_MD
            table.write_text(f"# {title}\n\n" + markdown_table(rows))
            mlflow_client.log_artifact(run_id, str(chart))
            mlflow_client.log_artifact(run_id, str(table))
        mlflow_client.set_tag(run_id, "fleetwise.sweep_children", str(len(rows)))
        if failed:
            mlflow_client.set_tag(run_id, "fleetwise.sweep_failed", str(failed))
        mlflow_client.set_terminated(run_id, status)
        where = f"; comparison in {sweep_dir / COMPARE_MD} and {sweep_dir / COMPARE_PNG}" if rows else ""
        _say(f"sweep {status}: {len(rows)} runs under the MLflow parent run {run_id}{where}")
        return status


def _say(message: str) -> None:
    print(f"fleetwise: {message}", flush=True)


def _warn(message: str) -> None:
    print(f"fleetwise: {message}", file=sys.stderr, flush=True)
