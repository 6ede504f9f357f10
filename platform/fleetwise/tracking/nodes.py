"""System metrics of every node of a multi-node job, in the job's one MLflow run.

Node 0's launcher owns the run (RunTracker, its sampler logs `system/node_0/...`). The other
nodes' launchers do not know the run id, and the nodes need not share a filesystem, so node 0
publishes it in the one thing every node of the job already reaches: torchrun's c10d rendezvous
store at `launch.rdzv_endpoint` (a TCPStore, alive while the job runs). Each other node waits for
the key and then runs MLflow's own sampler with `node_id=node_<rank>` into that run. Both sides
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
    """Node k > 0: wait for the run id, then sample this node's system metrics into that run."""

    def __init__(self, endpoint: str, node_rank: int, tracking_uri: str) -> None:
        self.endpoint, self.node_rank, self.uri = endpoint, node_rank, tracking_uri
        self.run_id: str | None = None
        self.error: str | None = None
        self._monitor: Any = None
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._started_at = 0.0
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
            store = _store(self.endpoint, CONNECT_TIMEOUT_S, self._stopping)
            while not self._stopping.is_set():
                if store.check([RUN_ID_KEY]):
                    break
                self._stopping.wait(0.2)
            else:
                return
            run_id = store.get(RUN_ID_KEY).decode()
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
        except Exception as exc:  # noqa: BLE001 - the store went away with the job, or MLflow is down
            self.error = str(exc)

    def stop(self) -> None:
        """Flush and stop the sampler (bounded: never hold up the end of the job for long)."""
        if self._thread.is_alive():
            self._started.wait(START_GRACE_S)
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
