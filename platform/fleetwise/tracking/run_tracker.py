"""The launcher's side of MLflow: one run per training job, fed from the metrics.jsonl spool.

Training ranks never talk to MLflow. Rank 0 appends one JSON line per optimizer step to
<run_dir>/metrics.jsonl; the launcher (the `fleetwise train` process on node 0, which outlives
crashed ranks and torchrun restarts) owns a RunTracker and ships new lines in batches:

    tracker = RunTracker(run_dir, experiment=cfg.tracking.experiment, run_name=name,
                         params=flatten_config(cfg), tags={...}, artifacts=[config, plan, command])
    tracker.start()                      # run id, or None (and one warning) if MLflow is down
    while job_is_running:
        tracker.poll(); time.sleep(1)    # never raises; backs off while the server is down
    tracker.add_artifacts(rank_logs)
    tracker.finish("FINISHED", summary=summarize(read_records(run_dir), warmup_steps))

What has reached MLflow is recorded in <run_dir>/tracking.json (see spool.py), so a server outage
only delays delivery: later polls, finish(), or `fleetwise sync` deliver the rest.
"""

from __future__ import annotations

import functools
import getpass
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetwise.rundir import ERROR_FILE, METRICS_FILE
from fleetwise.tracking.params import error_tag, flatten_config, git_commit, tag_value
from fleetwise.tracking.spool import (
    HEARTBEAT_EVERY_S,
    RunDirLock,
    TrackingState,
    finite,
    launcher_gone,
    load_state,
    metric_values,
    parse_record,
    read_lines,
    read_records,
    save_state,
)
from fleetwise.tracking.store import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
    clean_key,
    client,
    describe,
    ensure_experiment,
    rejected,
    tracking_uri,
)
from fleetwise.tracking.summary import summarize

__all__ = [
    "RunTracker",
    "flatten_config",
    "git_commit",
    "read_records",
    "summarize",
    "reap_orphans",
    "sync_run_dir",
    "tracking_uri",
]

STATUSES = ("FINISHED", "FAILED", "KILLED")
BACKOFF_FIRST_S = 2.0  # first retry after a failure; doubles up to BACKOFF_MAX_S
BACKOFF_MAX_S = 60.0
LOCK_WAIT_S = 30.0  # a `fleetwise sync` of the same dir may hold the lock for a moment
SYSTEM_METRICS_STOP_S = 5.0  # finish() never waits longer than this for the sampler thread
RUN_DIR_TAG = "fleetwise.run_dir"  # where a later command finds the run's tracking.json (reap_orphans)
LAST_SEEN_TAG = "fleetwise.last_seen"  # a run whose launcher died: when it was last seen (UTC)

Notify = Callable[[str], None]


def _to_stderr(message: str) -> None:
    print(f"fleetwise: {message}", file=sys.stderr, flush=True)


@dataclass
class _Line:
    end_offset: int
    malformed: bool = False  # not a JSON object (a blank line is neither shipped nor counted)
    rerun: bool = False  # a step at or before one already delivered (re-run after a resume)
    step: int | None = None  # the step this line delivers (None: malformed, a re-run, no metrics, refused)
    stamp: int = 0  # its timestamp, ms
    values: dict[str, float] = field(default_factory=dict)  # every metric of the step, by MLflow key
    metrics: list = field(default_factory=list)  # mlflow.entities.Metric: the points sent (see _elide)


class RunTracker:
    """One MLflow run of one training job, owned by the launcher (see the module docstring).

    Not thread-safe: call it from one thread (the launcher's loop). Its only thread is MLflow's
    system-metrics sampler, which has its own client."""

    def __init__(
        self,
        run_dir: Path,
        *,
        experiment: str,
        run_name: str,
        params: dict[str, object],
        tags: dict[str, str],
        artifacts: list[Path],
        parent_run_id: str | None = None,
        enabled: bool = True,
        system_metrics: bool = True,
        notify: Notify | None = None,
        datasets: list | None = None,
        node_id: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.experiment = experiment
        self.run_name = run_name
        self.params = flatten_config(params)  # already-flat params pass through unchanged
        self.tags = {str(k): tag_value(v) for k, v in tags.items() if v is not None}
        self.artifacts = [Path(p) for p in artifacts]
        self.parent_run_id = parent_run_id
        self.enabled = enabled
        self.system_metrics = system_metrics
        self.datasets = list(datasets or [])  # tracking.datasets.DatasetInfo: logged as run inputs
        self.node_id = node_id  # system metrics as system/<node_id>/... (a multi-node job's node 0)
        self.notify = notify if notify is not None else _to_stderr
        self.warning: str | None = None  # the last thing said to the user
        self.state: TrackingState | None = None
        self.uri: str | None = None
        self.delivered_total = 0  # steps this object has shipped
        self._previous: dict[str, float] = {}  # the metrics of the last step delivered (see _elide)
        self._lock = RunDirLock(self.run_dir)
        self._client: Any = None
        self._connected = False  # the run exists and has its params/tags
        self._resuming = False
        self._failures = 0
        self._retry_at = 0.0
        self._outage_told = False
        self._rejection_told = False
        self._sysmon: Any = None

    # -------------------------------------------------------------------------------------------
    # the interface the launcher uses

    def start(self) -> str | None:
        """Create the MLflow run, or continue the one recorded in run_dir/tracking.json (same run
        id: a job resumed from a checkpoint), and log params, tags and artifacts. Returns the run id,
        or None when tracking is off or MLflow is unreachable; then the user is told once, training
        goes on, and a later poll() creates the run and delivers the backlog."""
        if not self.enabled:
            return None
        if self.state is not None:
            return self.state.run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self._wait_for_lock():
            self._say(
                f"{self.run_dir} is tracked by another process (a `fleetwise sync`?); not logging this job"
            )
            self.enabled = False
            return None
        self.uri = tracking_uri()
        old = load_state(self.run_dir)
        artifacts = [str(self._resolve(p)) for p in self.artifacts]
        if old is not None and old.tracking_uri == self.uri:
            # Same run dir, same store: a resumed job continues its run and its cursor.
            self._resuming = old.run_id is not None
            old.final, old.closed, old.setup_done = None, False, False
            old.params, old.tags = self.params, {**old.tags, **self.tags}
            old.pending_artifacts += [a for a in artifacts if a not in old.pending_artifacts]
            self.state = old
        else:
            if old is not None and old.run_id is not None:
                self._say(
                    f"{self.run_dir} was tracked as run {old.run_id} in {old.tracking_uri}; this job logs to "
                    f"{self.uri} instead, as a new run that gets all of {METRICS_FILE}"
                )
            self.state = TrackingState(
                tracking_uri=self.uri,
                experiment=self.experiment,
                run_name=self.run_name,
                parent_run_id=self.parent_run_id,
                start_time_ms=_now_ms(),
                params=self.params,
                tags=self.tags,
                pending_artifacts=artifacts,
            )
        # this process owns the run from now on: a later command checks it is still alive
        self.state.launcher_host, self.state.launcher_pid = socket.gethostname(), os.getpid()
        self.state.heartbeat_ms = _now_ms()
        self._save()
        return self.state.run_id if self._connect() else None

    def heartbeat(self) -> None:
        """Stamp tracking.json every HEARTBEAT_EVERY_S, MLflow up or down (poll calls it)."""
        if not self._active() or self.state.final is not None or self.state.launcher_pid != os.getpid():
            return
        if _now_ms() - self.state.heartbeat_ms >= HEARTBEAT_EVERY_S * 1000:
            self.state.heartbeat_ms = _now_ms()
            self._save()

    def poll(self, max_batches: int = 10) -> int:
        """Ship new complete lines of metrics.jsonl (≤ 1000 metrics per request, at most
        `max_batches` requests so a long backlog never stalls the caller); return how many steps
        were delivered. Cheap when there is nothing new. Never raises: a failure is kept for a
        later poll, retried after a back-off of 2 s doubling up to 60 s."""
        self.heartbeat()
        if not self._active() or time.monotonic() < self._retry_at:
            return 0
        try:
            if not self._connected and not self._connect():
                return 0
            return self._ship(max_batches)
        except Exception as exc:  # a bug here must not kill training; the spool keeps the data
            self._failed(exc)
            return 0

    def add_artifacts(self, paths: list[Path]) -> None:
        """Queue files (e.g. each rank's log) for upload; they go now if MLflow answers, else later."""
        if not self._active():
            return
        for p in paths:
            path = str(self._resolve(Path(p)))
            if path not in self.state.pending_artifacts:
                self.state.pending_artifacts.append(path)
        self._save()
        if self._connected:
            try:
                self._upload_artifacts()
            except Exception as exc:
                self._failed(exc)

    def finish(
        self, status: str, *, error: str | None = None, summary: dict[str, float] | None = None
    ) -> None:
        """Deliver the remaining metrics, log `summary`, set the run's status (FINISHED, FAILED or
        KILLED). An `error` becomes the tag `fleetwise.error` (head and tail when long) and the
        artifact error.txt (whole). If MLflow is down, all of it waits in tracking.json for
        `fleetwise sync`."""
        status = status.upper()
        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {', '.join(STATUSES)}")
        if not self._active():
            return
        state = self.state
        if error:
            error_file = (self.run_dir / ERROR_FILE).resolve()
            error_file.write_text(error if error.endswith("\n") else error + "\n")
            if str(error_file) not in state.pending_artifacts:
                state.pending_artifacts.append(str(error_file))
        state.final = {
            "status": status,
            "error": error,
            "summary": dict(summary or {}),
            "end_time_ms": _now_ms(),
        }
        self._save()
        self._stop_system_metrics()
        try:
            done = self._complete()
        finally:
            self._lock.release()
        if not done:
            self._say(
                f"the end of this run has not reached MLflow yet; `fleetwise sync {self.run_dir}` delivers it"
            )

    @property
    def run_id(self) -> str | None:
        return self.state.run_id if self.state else None

    # -------------------------------------------------------------------------------------------
    # talking to MLflow

    def _connect(self) -> bool:
        """Make sure the run exists with its params and tags; False (and a back-off) on failure."""
        state = self.state
        try:
            if self._client is None:
                self._client = client(state.tracking_uri)
            mlflow_client = self._client
            run, created = None, False
            if state.run_id is not None:
                run = self._get_run(state.run_id)
                if run is None:
                    self._say(
                        f"run {state.run_id} no longer exists in {state.tracking_uri}; "
                        f"starting a new one with all of {METRICS_FILE}"
                    )
                    state.run_id, state.setup_done = None, False
                    state.delivered_lines = state.delivered_offset = state.skipped_lines = 0
                    state.rerun_lines = state.last_step = 0
            if state.run_id is None:
                experiment_id = ensure_experiment(mlflow_client, state.experiment, state.tracking_uri)
                run = mlflow_client.create_run(
                    experiment_id,
                    start_time=state.start_time_ms,
                    run_name=state.run_name,
                    tags=self._run_tags(),
                )
                state.run_id, created = run.info.run_id, True
                self._save()
            if self._resuming and run.info.status != "RUNNING":
                mlflow_client.update_run(state.run_id, status="RUNNING")
            self._resuming = False
            if not state.setup_done:
                self._log_setup({} if created else run.data.params, log_tags=not created)
                state.setup_done = True
                self._save()
            self._upload_artifacts()
        except Exception as exc:
            self._failed(exc)
            return False
        self._connected = True
        self._recovered()
        if state.final is None:
            self._start_system_metrics(resume=not created)
        return True

    def _get_run(self, run_id: str):
        from mlflow.exceptions import MlflowException

        try:
            return self._client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    def _run_tags(self) -> dict[str, str]:
        state = self.state
        tags = {
            "mlflow.user": _user(),
            "mlflow.source.type": "LOCAL",
            "mlflow.source.name": "fleetwise train",
            RUN_DIR_TAG: str(self.run_dir.resolve()),
        }
        if commit := state.tags.get("fleetwise.git_commit"):
            tags["mlflow.source.git.commit"] = commit  # the UI links the commit
        tags.update(state.tags)
        if state.parent_run_id:
            tags["mlflow.parentRunId"] = state.parent_run_id  # nests the run under its sweep
        return tags

    def _log_setup(self, existing: dict[str, str], *, log_tags: bool) -> None:
        from mlflow.entities import Param, RunTag

        state = self.state
        # MLflow params are immutable: a resumed job keeps the values its run started with.
        changed = sorted(k for k, v in state.params.items() if k in existing and existing[k] != v)
        new = [Param(k, v) for k, v in state.params.items() if k not in existing]
        for i in range(0, len(new), MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(state.run_id, params=new[i : i + MAX_PARAMS_TAGS_PER_BATCH])
        if log_tags:
            tags = [RunTag(k, v) for k, v in self._run_tags().items()]
            for i in range(0, len(tags), MAX_PARAMS_TAGS_PER_BATCH):
                self._client.log_batch(state.run_id, tags=tags[i : i + MAX_PARAMS_TAGS_PER_BATCH])
        if self.datasets:
            from fleetwise.tracking.datasets import log_dataset

            for info in self.datasets:
                log_dataset(self._client, state.run_id, info)
        if changed:
            shown = ", ".join(changed[:5]) + (", ..." if len(changed) > 5 else "")
            self._say(
                f"run {state.run_id} keeps the values it started with for {len(changed)} changed param(s) "
                f"({shown}): MLflow params cannot change; the new config is in {self.run_dir}/config.yaml"
            )

    def _upload_artifacts(self) -> None:
        state = self.state
        while state.pending_artifacts:
            path = Path(state.pending_artifacts[0])
            if path.is_dir():
                self._client.log_artifacts(state.run_id, str(path), artifact_path=path.name)
            elif path.exists():
                self._client.log_artifact(state.run_id, str(path), artifact_path=self._artifact_dir(path))
            else:
                self._say(f"artifact {path} does not exist; not uploaded")
            state.pending_artifacts.pop(0)
            self._save()

    def _artifact_dir(self, path: Path) -> str | None:
        """logs/rank_3.log keeps its folder in the run's artifacts; other files go to the root."""
        try:
            rel = path.resolve().relative_to(self.run_dir.resolve())
        except ValueError:
            return None
        return None if rel.parent == Path(".") else rel.parent.as_posix()

    def _ship(self, max_batches: int, *, final: bool = False) -> int:
        """Deliver up to `max_batches` batches of new lines; advance the cursor after each."""
        state = self.state
        path = self.run_dir / METRICS_FILE
        delivered = sent = 0
        while sent < max_batches:
            lines = read_lines(path, state.delivered_offset, final=final)
            if not lines:
                break
            for batch in self._batches(lines):
                if sent >= max_batches:
                    break
                ok = self._send(batch)
                delivered += ok
                sent += 1
                if not self._connected:
                    return delivered
        return delivered

    def _batches(self, raw: list[tuple[int, bytes]]) -> Iterator[list[_Line]]:
        """Whole lines grouped so that a batch holds at most MAX_METRICS_PER_BATCH metrics."""
        now, first_line = _now_ms(), self.state.delivered_lines  # before any batch advances it
        # After a resume the steps since the last checkpoint are trained again and appended again.
        # MLflow already has them (and cannot replace a point), so each step is logged once: the
        # first time. In fp32 on the same layout the re-run values are identical anyway;
        # metrics.jsonl keeps both.
        latest = self.state.last_step
        lines: list[_Line] = []
        for i, (end, text) in enumerate(raw):
            record = parse_record(text)
            line = _Line(end, malformed=record is None and bool(text.strip()))
            if record is not None:
                explicit = finite(record.get("step"))
                step = int(record["step"]) if explicit else first_line + i
                if explicit and step <= latest:
                    line.rerun = True
                else:
                    latest = max(latest, step)
                    line.values = {_key(k): v for k, v in metric_values(record).items()}
                    if line.values:
                        line.step = step
                        line.stamp = int(record["time"] * 1000) if finite(record.get("time")) else now
            lines.append(line)
        self._elide(lines)
        batch: list[_Line] = []
        count = 0
        for line in lines:
            if batch and count + len(line.values) > MAX_METRICS_PER_BATCH:  # room for it whole
                yield _whole_last(batch)
                batch, count = [], 0
            batch.append(line)
            count += len(line.metrics)
        if batch:
            yield _whole_last(batch)

    def _elide(self, lines: list[_Line]) -> None:
        """Each line's points to send: every metric of the step, except a value equal to the same
        metric's at the step before it and at the step after it, both in metrics.jsonl (a run of
        equal values is sent as its first and last step: world size, attempt, predicted and peak
        memory go a few times per delivery instead of every step). Lossless: a step missing from
        a metric's MLflow history has the value of the points on either side of it, which are
        equal, so a chart (lines between points) shows every step as it was. The decision reads
        only the file, so an outage or a crash between batches cannot make it wrong; and the last
        step of every batch is sent whole (_whole_last), so MLflow's latest value of every metric
        is always the newest delivered step's."""
        from mlflow.entities import Metric

        steps = [line for line in lines if line.step is not None]
        before = self._previous  # the values of the step delivered before these ({} if unknown)
        for i, line in enumerate(steps):
            after = steps[i + 1].values if i + 1 < len(steps) else None
            line.metrics = [
                Metric(k, v, line.stamp, line.step)
                for k, v in line.values.items()
                if after is None or not (_same(before.get(k), v) and _same(after.get(k), v))
            ]
            before = line.values

    def _send(self, batch: list[_Line]) -> int:
        """Log one batch; on success advance the cursor past it. Returns steps delivered."""
        metrics = [m for line in batch for m in line.metrics]
        try:
            for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
                self._client.log_batch(self.state.run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])
        except Exception as exc:
            if not rejected(exc):
                self._failed(exc)
                return 0
            if len(batch) > 1:
                # MLflow refused something in it: find the culprit line by line, keep the rest.
                return sum(self._send([line]) for line in batch if self._connected)
            self._reject(batch[0], exc)
        self._advance(batch)
        self._recovered()
        return sum(1 for line in batch if line.step is not None)

    def _advance(self, batch: list[_Line]) -> None:
        state = self.state
        state.delivered_offset = batch[-1].end_offset
        state.delivered_lines += len(batch)
        state.skipped_lines += sum(1 for line in batch if line.malformed)
        state.rerun_lines += sum(1 for line in batch if line.rerun)
        steps = [line.step for line in batch if line.step is not None]
        if steps:
            state.last_step = max(state.last_step, *steps)
        self._previous = next((line.values for line in reversed(batch) if line.values), self._previous)
        self.delivered_total += len(steps)
        self._save()

    def _reject(self, line: _Line, exc: BaseException) -> None:
        self.state.skipped_lines += 1
        line.metrics, line.step = [], None
        if not self._rejection_told:
            self._rejection_told = True
            self._say(
                f"MLflow refused a metrics line of {self.run_dir / METRICS_FILE}, skipped: {describe(exc)}"
            )

    def _complete(self) -> bool:
        """Everything finish() promises; True once the final status is on the run."""
        from mlflow.entities import Metric

        state = self.state
        if state.closed:
            return True
        if not self._connected and not self._connect():
            return False
        try:
            self._ship(sys.maxsize, final=True)
            if not self._connected:
                return False
            final = state.final
            if final.get("summary") and not final.get("summary_logged"):
                metrics = [
                    Metric(clean_key(k), float(v), final["end_time_ms"], state.last_step)
                    for k, v in final["summary"].items()
                    if finite(v)
                ]
                for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
                    self._client.log_batch(state.run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])
                final["summary_logged"] = True
                self._save()
            if final.get("error"):
                self._client.set_tag(state.run_id, "fleetwise.error", error_tag(final["error"]))
            elif (
                final["status"] == "FINISHED"
                and "fleetwise.error" in self._client.get_run(state.run_id).data.tags
            ):
                # a failed attempt that a resume carried to the end: its error no longer describes the run
                self._client.delete_tag(state.run_id, "fleetwise.error")
            self._upload_artifacts()
            self._client.set_terminated(state.run_id, final["status"], end_time=final["end_time_ms"])
        except Exception as exc:
            self._failed(exc)
            return False
        state.closed = True
        self._save()
        return True

    # -------------------------------------------------------------------------------------------
    # system metrics: MLflow's own sampler (CPU, RAM, disk, network; GPU with nvidia-ml-py)

    def _start_system_metrics(self, *, resume: bool) -> None:
        if not self.system_metrics or self._sysmon_alive():
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # Its start/stop notes and its "failed to get run" during an outage would repeat what
            # the tracker already tells the user once.
            logging.getLogger("mlflow.system_metrics").setLevel(logging.ERROR)
            monitor = SystemMetricsMonitor(
                self.state.run_id, resume_logging=resume, node_id=self.node_id, tracking_uri=self.uri
            )
            monitor.start()
            self._sysmon = monitor
        except Exception as exc:  # e.g. psutil missing: metrics of the job matter more
            self.system_metrics = False
            self._say(f"system metrics are off: {describe(exc)}")

    def _sysmon_alive(self) -> bool:
        # The sampler thread ends by itself when MLflow stops answering; poll() restarts it.
        thread = getattr(self._sysmon, "_process", None)
        return thread is not None and thread.is_alive()

    def _stop_system_metrics(self) -> None:
        monitor, self._sysmon = self._sysmon, None
        if monitor is None:
            return
        # finish() joins the sampler, which may sit in an HTTP call to a dead server: bound the wait
        # so a job's shutdown never hangs on it (the thread is a daemon and dies with the process).
        stopper = threading.Thread(target=monitor.finish, name="fleetwise-sysmetrics-stop", daemon=True)
        stopper.start()
        stopper.join(SYSTEM_METRICS_STOP_S)

    # -------------------------------------------------------------------------------------------
    # failures, back-off, messages, housekeeping

    def _failed(self, exc: BaseException) -> None:
        self._connected = False  # the next attempt re-checks the run: the server may have lost it
        self._failures += 1
        self._retry_at = time.monotonic() + min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self._failures - 1))
        if not self._outage_told:
            self._outage_told = True
            self._say(
                f"MLflow at {self.state.tracking_uri} is unreachable ({describe(exc)}). Training goes on; "
                f"metrics wait in {self.run_dir / METRICS_FILE} and are delivered when it answers again "
                f"(or by `fleetwise sync {self.run_dir}`)"
            )

    def _recovered(self) -> None:
        if self._outage_told:
            self._say(f"MLflow at {self.state.tracking_uri} answers again; delivering the waiting metrics")
        self._failures, self._retry_at, self._outage_told = 0, 0.0, False

    def _say(self, message: str) -> None:
        self.warning = message
        self.notify(message)

    def _active(self) -> bool:
        return self.enabled and self.state is not None and not self.state.closed

    def _save(self) -> None:
        save_state(self.run_dir, self.state)

    def _resolve(self, path: Path) -> Path:
        """Artifact paths may be given relative to the run dir (config.yaml) or to the cwd."""
        if not path.is_absolute() and (self.run_dir / path).exists():
            path = self.run_dir / path
        return path.resolve()

    def _wait_for_lock(self) -> bool:
        deadline = time.monotonic() + LOCK_WAIT_S
        while not self._lock.acquire():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True


def sync_run_dir(run_dir: Path, notify: Notify | None = None) -> int:
    """Deliver whatever of a run dir has not reached MLflow (metrics, params, artifacts, the final
    status and summary) to the store recorded in its tracking.json. Returns the steps delivered.
    A run dir whose launcher is still alive is left alone: that launcher delivers its own."""
    run_dir = Path(run_dir)
    state = load_state(run_dir)
    if state is None:
        return 0
    tracker = RunTracker(
        run_dir,
        experiment=state.experiment,
        run_name=state.run_name,
        params={},
        tags={},
        artifacts=[],
        parent_run_id=state.parent_run_id,
        system_metrics=False,
        notify=notify,
    )
    if not tracker._lock.acquire():
        tracker._say(f"{run_dir} belongs to a running job, which delivers its own metrics; skipped")
        return 0
    tracker.state, tracker.uri = state, state.tracking_uri
    try:
        if state.final is None and launcher_gone(state):
            _end_orphan(tracker)
        elif state.final is not None:
            tracker._complete()
        elif tracker._connect():
            # The lock was free: the launcher, and with it the job, is gone; a torn last line
            # will never be completed.
            tracker._ship(sys.maxsize, final=True)
    finally:
        tracker._lock.release()
    return tracker.delivered_total


def _end_orphan(tracker: RunTracker) -> None:
    """The run of a launcher that died without a word: what it left delivered, then KILLED, ended
    at the time it was last seen (its last heartbeat), with that time as a tag and in the error."""
    state = tracker.state
    seen = _utc(state.heartbeat_ms)
    why = (
        f"the launcher (pid {state.launcher_pid} on {state.launcher_host}) died without ending the run "
        f"(killed, or its machine went down); last seen {seen}"
    )
    state.final = {"status": "KILLED", "error": why, "summary": {}, "end_time_ms": state.heartbeat_ms}
    tracker._save()
    if tracker._complete():
        tracker._client.set_tag(state.run_id, LAST_SEEN_TAG, seen)
        tracker._say(f"run {state.run_id} ({tracker.run_dir}) marked KILLED: {why}")


def reap_orphans(mlflow_client, uri: str, notify: Notify | None = None, keep: str | None = None) -> list[str]:
    """Mark KILLED every RUNNING run of the store at `uri` whose launcher is gone (see
    spool.launcher_gone), found through the run dir each run names (RUN_DIR_TAG); `keep`: the
    caller's own run. Called by `fleetwise train`, `ui`, `compare`: a killed job's run never stays
    RUNNING. A run dir this machine cannot read is left alone (nothing says its launcher died).
    Returns the ids of the runs marked."""
    from mlflow.entities import ViewType

    ids = [e.experiment_id for e in mlflow_client.search_experiments(view_type=ViewType.ALL)]
    if not ids:
        return []
    runs = mlflow_client.search_runs(ids, filter_string="attributes.status = 'RUNNING'", max_results=1000)
    marked = []
    for run in runs:
        where = run.data.tags.get(RUN_DIR_TAG)
        if not where or run.info.run_id == keep:
            continue
        try:
            state = load_state(Path(where))
        except (OSError, ValueError, TypeError):  # unreadable or not ours: nothing to go by
            continue
        if state is None or state.run_id != run.info.run_id or state.tracking_uri != uri:
            continue
        if launcher_gone(state):
            sync_run_dir(Path(where), notify=notify)
            after = load_state(Path(where))
            if after is not None and after.closed:
                marked.append(run.info.run_id)
    return marked


def _utc(ms: int) -> str:
    import datetime

    stamp = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    return stamp.strftime("%Y-%m-%d %H:%M:%S UTC")


def _whole_last(batch: list[_Line]) -> list[_Line]:
    """The batch, its last step with all of its metrics (see RunTracker._elide)."""
    from mlflow.entities import Metric

    last = next((line for line in reversed(batch) if line.step is not None), None)
    if last is not None and len(last.metrics) < len(last.values):
        last.metrics = [Metric(k, v, last.stamp, last.step) for k, v in last.values.items()]
    return batch


@functools.lru_cache(maxsize=4096)
def _key(name: str) -> str:
    return clean_key(name)  # the same few names every step


def _same(a: float | None, b: float | None) -> bool:
    """Equal values, -0.0 and 0.0 told apart (NaN is never equal: always sent)."""
    return a is not None and b is not None and a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return "unknown"
