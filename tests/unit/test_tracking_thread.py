"""The launcher's MLflow thread yields the CPU to the ranks once they train (README: "Tracking runs
in MLflow"): nice STEPPING_NICE from the first growth of metrics.jsonl, not before."""

import os
import sys
import threading

import pytest

from fleetwise import rundir
from fleetwise.launcher.train import _Tracking


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a per-thread nice is Linux's")
def test_the_tracking_thread_yields_to_the_ranks_once_they_train(tmp_path):
    stop, ready = threading.Event(), threading.Event()
    tids: list[int] = []

    def stand_in():  # the tracking thread: alive until the test ends
        tids.append(threading.get_native_id())
        ready.set()
        stop.wait(30)

    thread = threading.Thread(target=stand_in, daemon=True)
    thread.start()
    ready.wait(10)
    try:
        t = object.__new__(_Tracking)  # only what _yield_to_ranks reads
        t.run_dir, t._tid, t._yielded = tmp_path, tids[0], False
        t._metrics_at_start = -1  # no metrics.jsonl when the job started
        before = os.getpriority(os.PRIO_PROCESS, tids[0])
        t._yield_to_ranks()
        assert os.getpriority(os.PRIO_PROCESS, tids[0]) == before  # ranks not training yet
        rundir.metrics_path(tmp_path).write_text('{"step": 1}\n')
        t._yield_to_ranks()
        assert os.getpriority(os.PRIO_PROCESS, tids[0]) == max(before, _Tracking.STEPPING_NICE)
        assert os.getpriority(os.PRIO_PROCESS, 0) == before  # the launcher's own thread keeps its share
    finally:
        stop.set()
        thread.join()
