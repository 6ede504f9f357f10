"""The launcher's MLflow thread yields the CPU to the ranks once they train (README: "Tracking runs
in MLflow"): nice STEPPING_NICE from the first growth of metrics.jsonl once the run exists, not before; and a delivery
every DELIVER_EVERY_S from then on, not every POLL_EVERY_S."""

import os
import sys
import threading
import time

import pytest

from fleetwise import rundir
from fleetwise.launcher.job_tracking import JobTracking


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
        t = object.__new__(JobTracking)  # only what _yield_to_ranks reads
        t.run_dir, t._tid, t._yielded = tmp_path, tids[0], False
        t._metrics_at_start = -1  # no metrics.jsonl when the job started
        before = os.getpriority(os.PRIO_PROCESS, tids[0])
        t._yield_to_ranks()
        assert os.getpriority(os.PRIO_PROCESS, tids[0]) == before  # ranks not training yet
        rundir.metrics_path(tmp_path).write_text('{"step": 1}\n')
        t._tid = None  # the thread still creating the run: it keeps its share
        t._yield_to_ranks()
        assert os.getpriority(os.PRIO_PROCESS, tids[0]) == before
        t._tid = tids[0]
        t._yield_to_ranks()
        assert os.getpriority(os.PRIO_PROCESS, tids[0]) == max(before, JobTracking.STEPPING_NICE)
        assert os.getpriority(os.PRIO_PROCESS, 0) == before  # the launcher's own thread keeps its share
    finally:
        stop.set()
        thread.join()


def test_the_tracking_thread_delivers_less_often_once_the_ranks_train(tmp_path, monkeypatch):
    polls: list[int] = []

    class Tracker:  # stands in for RunTracker: records when it is asked to deliver
        def poll(self, max_batches: int = 10) -> int:
            polls.append(max_batches)
            return 0

    monkeypatch.setattr(JobTracking, "POLL_EVERY_S", 0.02)
    monkeypatch.setattr(JobTracking, "DELIVER_EVERY_S", 0.5)
    t = object.__new__(JobTracking)  # only what _deliver reads
    t.tracker, t._yielded, t._stop, t._tid = Tracker(), False, threading.Event(), None
    while_starting: list = []
    t.start = lambda: while_starting.append(t._tid)  # creates the run
    thread = threading.Thread(target=t._deliver, daemon=True)
    thread.start()
    try:
        time.sleep(1.0)
        before = len(polls)
        t._yielded = True  # the ranks train (what _yield_to_ranks sets)
        time.sleep(0.1)  # the wait under way when they started ends
        during = len(polls)
        time.sleep(1.6)
        after = len(polls) - during
    finally:
        t._stop.set()
        thread.join(10)
    assert before >= 5, before  # every 0.02 s while the ranks start (fewer on a loaded machine)
    assert after <= 4, after  # every 0.5 s once they train: ~3 in 1.6 s, not ~80
    assert set(polls) == {JobTracking.MAX_BATCHES}  # a delivery takes the whole backlog
    # the thread can be niced only once the run exists: not while `start` creates it
    assert while_starting == [None] and t._tid is not None
