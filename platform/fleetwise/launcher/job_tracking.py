"""The job's MLflow run, owned by the launcher on node 0 (`JobTracking`): created once the ranks
start, fed from rank 0's metrics.jsonl in batches, finished with the job's status, summary and
model; and the run's params without secrets (`redact_params`).

A multi-node job's other nodes log their system metrics to the same run (fleetwise.tracking.nodes).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from fleetwise import rundir
from fleetwise.launcher.auto import AutoOutcome

REDACTED = "<redacted>"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def redact_params(params: dict[str, str], env_paths=(), environ=None) -> dict[str, str]:
    """MLflow params without secrets: values read from the environment (${oc.env:…}), and any
    value equal to a credential in the environment (a tracking password, a token)."""
    import os

    from fleetwise.launcher.torchrun import is_secret_name

    environ = os.environ if environ is None else environ
    secrets = {v for k, v in environ.items() if is_secret_name(k) and len(v) >= 4}
    return {k: REDACTED if k in env_paths or any(s in v for s in secrets) else v for k, v in params.items()}


class JobTracking:
    """The job's MLflow run, owned by this launcher on node 0 (it outlives crashed ranks and torchrun
    restarts). It ships rank 0's metrics.jsonl in batches; metrics.jsonl doubles as the spool when
    the tracking server is away (`fleetwise sync` delivers what is left)."""

    POLL_EVERY_S = 1.0  # until the ranks train (MLflow's start-up, an outage's retries)
    # Once they train: a delivery every 10 s (MLflow's charts are at most that far behind). Measured
    # here: a log_batch into sqlite costs ~8 ms of CPU however few points it carries, plus 60-110 µs
    # a point; 1,000-point batches instead of one call a second for 2-rank gpt/tiny's ~33 steps.
    DELIVER_EVERY_S = 10.0
    MAX_BATCHES = 100  # per delivery in the thread: 100,000 points, any step rate's 10 s and more
    # The tracking thread's nice value once the ranks train (Linux keeps one per thread). Measured
    # on 2 cores, 2-rank gpt/tiny: the launcher spent 4-13% of a core inside the steps' window,
    # mostly MLflow's start-up (import, run, params: ~4 s of CPU) still running when the steps began.
    STEPPING_NICE = 10

    def __init__(
        self,
        cfg,
        plan,
        run_dir: Path,
        env_paths=frozenset(),
        auto: AutoOutcome | None = None,
        job_id: str | None = None,
    ):
        self.cfg, self.plan, self.run_dir = cfg, plan, run_dir
        self.job_id = job_id  # a multi-node job's rendezvous id, alike on every node: its run's tag
        self.auto = auto
        self.env_paths = env_paths  # config paths read from the environment: kept out of the params
        self.tracker = None
        self.enabled = cfg.tracking.enabled and cfg.launch.node_rank == 0
        self.last_poll = self.last_delivery = 0.0
        # a multi-node job: node 0 hands the run id to the other nodes, which log their system metrics
        self.multi_node = cfg.tracking.enabled and cfg.tracking.system_metrics and cfg.hardware.nodes > 1
        self.publisher = None
        self.node_metrics = None
        self._thread = None  # start_background's: RunTracker is used by it alone until finish joins it
        self._stop = threading.Event()
        self._tid: int | None = None  # the tracking thread's, once its `start` is done (the run exists)
        self._metrics_at_start = -1
        self._yielded = False

    def start(self) -> None:
        """Called once torchrun runs: importing mlflow (~2.5 s) overlaps the ranks' start-up."""
        if self.multi_node and self.cfg.launch.node_rank > 0:
            from fleetwise.tracking.nodes import NodeSystemMetrics
            from fleetwise.tracking.store import tracking_uri

            launch = self.cfg.launch
            self.node_metrics = NodeSystemMetrics(
                launch.rdzv_endpoint,
                launch.node_rank,
                tracking_uri(),
                self.job_id,
                self.cfg.tracking.experiment,
            )
            self.node_metrics.start()
        if not self.enabled:
            return
        from fleetwise.tracking.run_tracker import RunTracker, flatten_config, git_commit
        from fleetwise.tracking.sweep import parent_run_id_from_hydra

        cfg = self.cfg
        tags = {
            **cfg.tracking.tags,  # the user's own (reserved prefixes refused by validation)
            "fleetwise.recipe": cfg.recipe,
            "fleetwise.strategy": cfg.strategy.name,
            "fleetwise.hardware": cfg.hardware.name,
            "fleetwise.world_size": str(self.plan.world_size),
        }
        if self.multi_node and self.job_id:  # how the other nodes find the run when the store is gone
            from fleetwise.tracking.nodes import JOB_TAG

            tags[JOB_TAG] = self.job_id
        commit = git_commit()
        if commit:
            tags["fleetwise.git_commit"] = commit
        artifacts = [Path(name) for name in rundir.RUN_ARTIFACTS]
        if self.auto is not None:  # strategy=auto: the chosen layout and the candidates weighed
            tags["fleetwise.strategy"] = "auto"
            tags["fleetwise.auto_override"] = self.auto.override_text
            artifacts.append(Path(rundir.AUTO_SEARCH_FILE))
        name = cfg.run.name or f"{cfg.recipe.replace('/', '-')}-{cfg.strategy.name}-{cfg.hardware.name}"
        from fleetwise.tracking.datasets import describe_data

        self.tracker = RunTracker(
            self.run_dir,
            experiment=cfg.tracking.experiment,
            run_name=name,
            params=redact_params(flatten_config(cfg.model_dump(mode="json")), self.env_paths),
            tags=tags,
            artifacts=artifacts,
            parent_run_id=parent_run_id_from_hydra(),
            system_metrics=cfg.tracking.system_metrics,
            datasets=[describe_data(cfg)],
            node_id="node_0" if cfg.hardware.nodes > 1 else None,
        )
        self.tracker.start()
        self._reap()
        if self.multi_node:
            from fleetwise.tracking.nodes import RunIdPublisher

            self.publisher = RunIdPublisher(cfg.launch.rdzv_endpoint)
            if self.tracker.run_id:
                self.publisher.publish(self.tracker.run_id)

    def _reap(self) -> None:
        """Runs of this store whose launcher was killed (kill -9, a lost node) marked KILLED, so that
        none stays RUNNING forever; a failure here never touches the job."""
        if self.tracker.run_id is None:
            return
        from fleetwise.tracking.run_tracker import reap_orphans
        from fleetwise.tracking.store import describe

        try:
            reap_orphans(
                self.tracker._client, self.tracker.uri, self.tracker.notify, keep=self.tracker.run_id
            )
        except Exception as exc:  # noqa: BLE001 - housekeeping of other runs
            self.tracker.notify(f"could not check the store's other RUNNING runs: {describe(exc)}")

    def start_background(self) -> None:
        """`start`, then a delivery every POLL_EVERY_S, in a thread of this launcher: called once
        torchrun runs, so that importing mlflow (~2.5 s) overlaps the ranks' start-up; once the
        ranks train (`poll` sees metrics.jsonl grow) the thread yields the CPU to them and delivers
        every DELIVER_EVERY_S. A multi-node job's run is handled in the launcher's own loop (its id
        goes to the other nodes)."""
        if not self.enabled or self.multi_node:
            self.start()
            return
        self._metrics_at_start = _size(rundir.metrics_path(self.run_dir))
        self._thread = threading.Thread(target=self._deliver, name="fleetwise-tracking", daemon=True)
        self._thread.start()

    def _deliver(self) -> None:
        try:
            self.start()
            self._tid = threading.get_native_id()  # from now on `_yield_to_ranks` may nice it
            while not self._stop.wait(self.DELIVER_EVERY_S if self._yielded else self.POLL_EVERY_S):
                if self.tracker is not None:
                    self.tracker.poll(max_batches=self.MAX_BATCHES)  # never raises
        except Exception as exc:  # a bug here must not kill the job; the spool keeps the metrics
            print(f"fleetwise: MLflow tracking stopped: {exc}", file=sys.stderr, flush=True)

    def _yield_to_ranks(self) -> None:
        """Once the ranks train and the run exists, the tracking thread runs at nice STEPPING_NICE:
        on a machine whose cores the ranks fill, MLflow's deliveries take only what they leave idle
        (a rank waking from a collective preempts it). Not before the run exists: its start-up
        (importing MLflow, creating the run, ~2.5 CPU-s once) keeps its share, so that the run shows
        in MLflow while the job trains -- niced from the ranks' first step, on a loaded machine it
        took minutes (the SIGTERM test under two CPU hogs: 74-170 s, 13-14 s idle). The thread keeps
        the value (lowering it needs privileges), and `finish` runs in the launcher's own thread."""
        if self._yielded or self._tid is None:
            return
        if _size(rundir.metrics_path(self.run_dir)) == self._metrics_at_start:
            return
        self._yielded = True
        if sys.platform.startswith("linux"):  # elsewhere the id of a thread is not a process's
            import contextlib
            import os

            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, self._tid, self.STEPPING_NICE)

    def poll(self) -> None:
        import time

        if self._thread is not None:
            self._yield_to_ranks()
            return
        if self.tracker is None or time.monotonic() - self.last_poll < self.POLL_EVERY_S:
            return
        self.last_poll = time.monotonic()
        training = _size(rundir.metrics_path(self.run_dir)) > 0
        if not training or self.last_poll - self.last_delivery >= self.DELIVER_EVERY_S:
            self.last_delivery = self.last_poll
            self.tracker.poll()
        if self.publisher is not None and self.tracker.run_id:
            self.publisher.publish(self.tracker.run_id)

    def finish(self, status: str, error: str | None, summary: dict) -> str | None:
        if self._thread is not None:  # its last delivery done, the rest happens here
            self._stop.set()
            self._thread.join()
        if self.node_metrics is not None:
            self.node_metrics.stop()
            if self.node_metrics.run_id is None:
                why = self.node_metrics.error or "node 0 published no MLflow run id"
                print(f"fleetwise: this node's system metrics were not logged: {why}", file=sys.stderr)
        if self.tracker is None:
            return None
        if self.publisher is not None:
            self.publisher.stop()
            if not self.publisher.done.is_set():
                why = self.publisher.error or "the job ended before the rendezvous store took the run id"
                self.tracker.notify(f"the other nodes' system metrics were not logged: {why}")
        self.tracker.add_artifacts(rundir.rank_logs(self.run_dir) + [rundir.launcher_log(self.run_dir)])
        if status == "FINISHED":
            self.log_model()
        self.tracker.finish(status, error=error, summary=summary)
        return self.tracker.run_id

    def log_model(self) -> None:
        """The trained model as an MLflow model (tracking/models.py). Training succeeded: a failure
        here is reported, never turned into a failed job."""
        from fleetwise.runtime.checkpoint_files import final_weights
        from fleetwise.tracking.store import describe

        cfg, run_id = self.cfg, self.tracker.run_id
        if not cfg.tracking.log_model or cfg.strategy.name == "ps":  # ps: the shards of RUN_DIR/ps
            return
        weights = final_weights(cfg, self.run_dir)
        later = f"log it later with `fleetwise checkpoint export {self.run_dir} --log-model`"
        if run_id is None or weights is None:
            why = "MLflow is unreachable" if run_id is None else "the job left no final weights"
            self.tracker.notify(f"the model was not logged ({why}); {later}")
            return
        from fleetwise.tracking.models import log_model

        try:
            logged = log_model(
                self.tracker.uri,
                run_id,
                weights,
                cfg=cfg,
                plan=self.plan,
                register_as=cfg.tracking.register_as,
                step=cfg.train.steps,
            )
        except Exception as exc:  # noqa: BLE001 - the job itself succeeded
            self.tracker.notify(f"the model was not logged: {describe(exc)}; {later}")
            return
        what = "weights" if logged["kind"] == "weights" else "a reference to the sharded checkpoint"
        note = f", eval/loss {logged['eval_loss']:.4f}" if "eval_loss" in logged else ""
        reg = (
            f", registered as {cfg.tracking.register_as} v{logged['version']}" if "version" in logged else ""
        )
        hf = f"; Hugging Face directory: {logged['hf_uri']}" if "hf_uri" in logged else ""
        self.tracker.notify(f"model logged ({what}{note}{reg}): {logged['model_uri']}{hf}")
