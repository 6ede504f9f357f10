"""The metrics.jsonl spool, its cursor file, the run-dir lock and the summary: no MLflow at all."""

import json
import subprocess
import sys
import textwrap

import pytest

from fleetwise.rundir import METRICS_FILE
from fleetwise.tracking.spool import (
    RunDirLock,
    TrackingState,
    is_behind,
    load_state,
    metric_values,
    parse_record,
    read_lines,
    read_records,
    save_state,
)
from fleetwise.tracking.summary import summarize


def test_only_complete_lines_are_read_and_offsets_point_past_them(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_bytes(b'{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    lines = read_lines(path, 0)
    assert [text for _, text in lines] == [b'{"step": 1, "a": 1}\n', b'{"step": 2, "a": 2}\n']
    assert lines[-1][0] == len(b'{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n')
    assert read_lines(path, lines[-1][0]) == []  # the torn line waits for its newline
    # final=True (the writer is gone): the trailing fragment comes too, to be skipped if torn.
    (end, text) = read_lines(path, lines[-1][0], final=True)[0]
    assert end == path.stat().st_size and parse_record(text) is None
    with open(path, "ab") as f:
        f.write(b": 3}\n")
    assert parse_record(read_lines(path, lines[-1][0])[0][1]) == {"step": 3, "a": 3}
    assert read_lines(tmp_path / "missing.jsonl", 0) == []


def test_records_keep_numbers_only():
    record = parse_record(
        b'{"step": 4, "time": 1.5, "train/loss": 2.5, "perf/mfu": 0, "ok": true, "s": "x"}\n'
    )
    assert metric_values(record) == {"train/loss": 2.5, "perf/mfu": 0.0}
    assert parse_record(b"[1, 2]\n") is None and parse_record(b"not json\n") is None
    import numpy as np

    # summaries computed with numpy count as numbers too
    assert metric_values({"a": np.float32(0.5), "b": np.int64(3)}) == {"a": 0.5, "b": 3.0}


def test_state_round_trip_and_is_behind(tmp_path):
    assert load_state(tmp_path) is None and not is_behind(tmp_path)
    state = TrackingState(tracking_uri="sqlite:////x.db", experiment="e", run_name="r", run_id="abc")
    state.setup_done = True
    save_state(tmp_path, state)
    assert load_state(tmp_path) == state
    assert not is_behind(tmp_path)
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "a": 1}\n')
    assert is_behind(tmp_path)  # a line not delivered yet
    state.delivered_offset = (tmp_path / METRICS_FILE).stat().st_size
    save_state(tmp_path, state)
    assert not is_behind(tmp_path)
    state.final = {"status": "FINISHED"}
    save_state(tmp_path, state)
    assert is_behind(tmp_path)  # the final status has not reached MLflow
    # Unknown keys from a newer fleetwise are ignored, not fatal.
    data = json.loads((tmp_path / "tracking.json").read_text()) | {"future_key": 1}
    (tmp_path / "tracking.json").write_text(json.dumps(data))
    assert load_state(tmp_path).run_id == "abc"


@pytest.mark.slow  # starts processes
def test_run_dir_lock_is_exclusive_across_processes_and_dies_with_its_holder(tmp_path):
    lock = RunDirLock(tmp_path)
    assert lock.acquire()
    probe = textwrap.dedent(
        f"""
        from fleetwise.tracking.spool import RunDirLock
        print(RunDirLock({str(tmp_path)!r}).acquire())
        """
    )
    held = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert held.stdout.strip() == "False", held.stderr
    lock.release()
    free = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert free.stdout.strip() == "True", free.stderr


def _records():
    # 5 steps; the first 2 are warm-up (slow). Hand-computable numbers.
    rows = [
        (1, 4.0, 10.0, 100.0, 0.10, 1200, 5.0),
        (2, 2.0, 20.0, 200.0, 0.20, 1000, 4.0),
        (3, 1.0, 40.0, 400.0, 0.40, 1100, 3.0),
        (4, 3.0, 30.0, 300.0, 0.30, 1050, 2.5),
        (5, 2.0, 50.0, 500.0, 0.50, 1000, 2.0),
    ]
    return [
        {
            "step": s,
            "perf/step_time_s": t,
            "perf/samples_per_s": sps,
            "perf/tokens_per_s": tps,
            "perf/mfu": mfu,
            "memory/peak_bytes_max": peak,
            "memory/predicted_bytes": 800,
            "train/loss": loss,
        }
        for s, t, sps, tps, mfu, peak, loss in rows
    ]


def test_summarize_leaves_warmup_out_of_throughput_but_not_out_of_memory():
    s = summarize(_records(), warmup_steps=2)
    assert s["summary/steps"] == 5 and s["summary/steps_measured"] == 3
    assert s["summary/step_time_median_s"] == 2.0  # median of 1, 3, 2
    assert s["summary/step_time_mean_s"] == 2.0
    assert s["summary/samples_per_s_mean"] == 40.0  # (40 + 30 + 50) / 3
    assert s["summary/tokens_per_s_mean"] == 400.0
    assert s["summary/mfu_mean"] == pytest.approx(0.4)
    assert s["summary/peak_bytes_max"] == 1200  # a peak is a peak: warm-up step 1 counts
    assert s["summary/predicted_bytes"] == 800
    assert s["summary/memory_ratio"] == 1.5
    assert s["summary/final_loss"] == 2.0
    assert "summary/tflops_per_device_mean" not in s  # no such metric in the records


def test_summarize_short_runs_missing_and_nonfinite_values():
    assert summarize([], 2) == {}
    short = summarize(_records()[:2], warmup_steps=5)
    assert short["summary/steps_measured"] == 2  # shorter than the warm-up: use every step
    recs = _records()
    recs[4]["train/loss"] = float("nan")
    recs[3]["perf/samples_per_s"] = float("inf")
    s = summarize(recs, 2)
    assert s["summary/final_loss"] == 2.5  # the last finite loss
    assert s["summary/samples_per_s_mean"] == 45.0
    assert summarize([{"step": 1, "train/loss": 3.0}], 0) == {
        "summary/steps": 1.0,
        "summary/steps_measured": 1.0,
        "summary/final_loss": 3.0,
    }


def test_read_records_skips_torn_and_malformed_lines(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\ngarbage\n\n{"step": 2}\n{"step": 3')
    assert read_records(tmp_path) == [{"step": 1}, {"step": 2}]
