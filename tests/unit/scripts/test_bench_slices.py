"""scripts/bench_slices.py: two jobs taking turns never run at the same time, and only steps
wholly inside their own job's windows are counted."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from helpers.repo import REPO

spec = importlib.util.spec_from_file_location("bench_slices", REPO / "scripts" / "bench_slices.py")
slices = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slices)

# a job that stamps the wall clock every ~2 ms of its own running, 300 times
STAMPER = """
import sys, time
out = open(sys.argv[1], "w")
for _ in range(300):
    t = time.perf_counter()
    while time.perf_counter() - t < 0.002:
        pass
    out.write(f"{time.time()!r}\\n")
    out.flush()
"""


def test_jobs_taking_turns_only_run_inside_their_own_windows(tmp_path):
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    jobs = [([sys.executable, "-c", STAMPER, str(f)], None) for f in files]
    windows = slices.take_turns(jobs, slice_s=0.05)
    stamps = [[float(x) for x in f.read_text().split()] for f in files]
    assert [len(s) for s in stamps] == [300, 300]  # both ran to the end
    for own, ts in zip(windows, stamps, strict=True):
        assert len(own) >= 3  # they really took turns (each ran ~0.6 s of 50 ms slices)
        outside = [t for t in ts if not any(a <= t <= b for a, b in own)]
        assert outside == []
    # and the two jobs' windows never overlap
    spans = sorted(w for own in windows for w in own)
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:], strict=False))


def test_a_failing_job_raises_with_its_output():
    jobs = [
        ([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], None),
        ([sys.executable, "-c", "pass"], None),
    ]
    with pytest.raises(RuntimeError, match=r"failed \(3\)[\s\S]*boom"):
        slices.take_turns(jobs, slice_s=0.05)


def test_only_steps_wholly_inside_a_window_count():
    windows = [(10.0, 11.0), (12.0, 13.0)]
    records = [  # step s ends at `time` and took `t` seconds
        {"step": 1, "time": 10.2, "t": 0.1},  # inside, but a warm-up step
        {"step": 4, "time": 10.5, "t": 0.2},  # inside
        {"step": 5, "time": 11.3, "t": 0.4},  # began inside, ended while stopped
        {"step": 6, "time": 12.1, "t": 0.3},  # began before its window opened (straddles the swap)
        {"step": 7, "time": 12.4, "t": 0.3},  # inside the second window
    ]
    assert slices.steps_inside(records, windows, "t", first=3) == [0.2, 0.3]
    # intervals between step ends: both ends in one window (10.2 -> 10.5 is a warm-up's; 12.1 -> 12.4 counts)
    assert slices.intervals_inside(records, windows, first=4) == pytest.approx([0.3])
