"""System metrics of every node of a multi-node job, in the job's one MLflow run.

Node 0's launcher owns the run (RunTracker, its sampler logs `system/node_0/...`). The other
nodes' launchers do not know the run id, and the nodes need not share a filesystem, so node 0
publishes it in the one thing every node of the job already reaches: torchrun's c10d rendezvous
store at `launch.rdzv_endpoint` (a TCPStore, alive while the job runs). Each other node waits for
the key and then runs MLflow's own sampler with `node_id=node_<rank>` into that run; where the job
ended before the key was there, it finds the run in MLflow by the job's tag (JOB_TAG). Both sides
work in a daemon thread, so a slow or absent store never holds up the launcher's loop; if the id
never arrives (tracking off or MLflow down on node 0), that node simply logs nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

RUN_ID_KEY = "fleetwise/mlflow_run_id"
JOB_TAG = "fleetwise.job_id"  # node 0's run of a multi-node job: its rendezvous id
RUN_LOOKUP_SLACK_MS = 120_000  # a run found by JOB_TAG started at most this long before this node (clocks)
CONNECT_TIMEOUT_S = 600.0  # torchrun may take minutes to bring the store up on a busy cluster
STOP_TIMEOUT_S = 5.0
ATTEMPT_S = 3.0  # one connection attempt to the store
# At the end of a short job the sampler may not be up yet (mlflow import, node 0's id): wait this
# long for it, and let it take one sample, so every node appears in the run.
START_GRACE_S = 20.0


def node_id(node_rank: int) -> str:
    return f"node_{node_rank}"


def _store(endpoint: str, timeout_s: float, stopping: threading.Event | None = None):
    """A client of the rendezvous store. Short attempts in a loop: one long attempt backs off
    for tens of seconds after a refused connection (the store is not up yet), longer than a short
    job lives."""
    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return TCPStore(
                host, int(port), is_master=False, timeout=timedelta(seconds=ATTEMPT_S), wait_for_workers=False
            )
        except Exception:  # noqa: BLE001 - refused or timed out: not up yet
            if time.monotonic() > deadline or (stopping is not None and stopping.is_set()):
                raise
            time.sleep(0.5)


class RunIdPublisher:
    """Node 0: put the run id into the rendezvous store once (in a thread)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.thread: threading.Thread | None = None
        self.error: str | None = None
        self.done = threading.Event()
        self._stopping = threading.Event()

    def publish(self, run_id: str) -> None:
        if self.thread is not None:
            return

        def run() -> None:
            try:
                _store(self.endpoint, CONNECT_TIMEOUT_S, self._stopping).set(RUN_ID_KEY, run_id)
                self.done.set()
            except Exception as exc:  # noqa: BLE001 - other nodes then log no system metrics
                self.error = str(exc)

        self.thread = threading.Thread(target=run, name="fleetwise-publish-run-id", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Give up connecting; wait for an attempt in flight (a thread left inside the store's C++
        connect when the interpreter exits aborts the process)."""
        self._stopping.set()
        if self.thread is not None:
            self.thread.join(ATTEMPT_S + 2.0)


class NodeSystemMetrics:
    """Node k > 0: wait for the run id, then sample this node's system metrics into that run.

    The id comes from the rendezvous store while the job runs. A short job on a busy node 0 can
    end (and its agent take the store down) before node 0's launcher has created the run: then the
    run is looked up in MLflow itself by the job's tag (JOB_TAG, the multi-node job's rendezvous
    id, which every node derives alike) while `stop` waits its grace period."""

    def __init__(
        self,
        endpoint: str,
        node_rank: int,
        tracking_uri: str,
        job_id: str | None = None,
        experiment: str = "",
    ) -> None:
        self.endpoint, self.node_rank, self.uri = endpoint, node_rank, tracking_uri
        self.job_id, self.experiment = job_id, experiment
        self.run_id: str | None = None
        self.error: str | None = None
        self._monitor: Any = None
        self._stopping = threading.Event()
        self._job_ended = threading.Event()  # the store is gone with the job: MLflow only
        self._started = threading.Event()
        self._started_at = 0.0
        self._since_ms = int(time.time() * 1000) - RUN_LOOKUP_SLACK_MS
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="fleetwise-node-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            # mlflow first (seconds): ready to sample as soon as the id arrives
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            from fleetwise.tracking.store import configure_http

            configure_http()
            logging.getLogger("mlflow.system_metrics").setLevel(logging.ERROR)
            run_id = self._run_id_from_store() or self._run_id_from_mlflow()
            if run_id is None:
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                self._monitor = SystemMetricsMonitor(
                    run_id, resume_logging=True, node_id=node_id(self.node_rank), tracking_uri=self.uri
                )
                self._monitor.start()
                self.run_id = run_id
                self._started_at = time.monotonic()
                self._started.set()
        except Exception as exc:  # noqa: BLE001 - MLflow is down, or its store refused the sampler
            self.error = str(exc)

    def _run_id_from_store(self) -> str | None:
        try:
            store = _store(self.endpoint, CONNECT_TIMEOUT_S, self._job_ended)
            while not self._job_ended.is_set():
                if store.check([RUN_ID_KEY]):
                    return store.get(RUN_ID_KEY).decode()
                self._job_ended.wait(0.2)
        except Exception as exc:  # noqa: BLE001 - the store went away with the job
            self.error = str(exc)
        return None

    def _run_id_from_mlflow(self) -> str | None:
        """Node 0's run of this job, by its tag, once it exists (until `stop` gives up)."""
        if not self.job_id:
            return None
        from fleetwise.tracking.store import client

        mlflow_client = client(self.uri)
        query = f"tags.`{JOB_TAG}` = '{self.job_id}' and attributes.start_time >= {self._since_ms}"
        while not self._stopping.is_set():
            exp = mlflow_client.get_experiment_by_name(self.experiment)
            runs = (
                mlflow_client.search_runs(
                    [exp.experiment_id], query, max_results=1, order_by=["attributes.start_time DESC"]
                )
                if exp
                else []
            )
            if runs:
                self.error = None
                return runs[0].info.run_id
            self._stopping.wait(0.5)
        return None

    def stop(self) -> None:
        """Flush and stop the sampler (bounded: never hold up the end of the job for long)."""
        self._job_ended.set()
        deadline = time.monotonic() + START_GRACE_S
        while self._thread.is_alive() and not self._started.is_set() and time.monotonic() < deadline:
            self._thread.join(0.1)  # until sampling, or the thread found nothing to sample into
        if self._started.is_set():
            first_sample = self._started_at + 1.5 * self._monitor.sampling_interval
            time.sleep(max(0.0, min(first_sample - time.monotonic(), START_GRACE_S)))
        self._stopping.set()
        with self._lock:
            monitor, self._monitor = self._monitor, None
        if monitor is not None:
            stopper = threading.Thread(target=monitor.finish, daemon=True)
            stopper.start()
            stopper.join(STOP_TIMEOUT_S)
