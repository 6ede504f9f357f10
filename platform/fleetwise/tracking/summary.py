"""End-of-run summary metrics, computed from the per-step records of metrics.jsonl."""

from __future__ import annotations

import statistics

from fleetwise.tracking.spool import finite


def _values(records: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in records if finite(r.get(key))]


def summarize(records: list[dict], warmup_steps: int) -> dict[str, float]:
    """Summary metrics of a run; throughput and step time leave out the first `warmup_steps`
    records (start-up, allocator and compilation warm-up), memory and loss use every step.

    A run no longer than its warm-up is summarised over all its steps: a noisy number beats none.
    Keys only appear when the records carry the metric they are computed from.
    """
    records = [r for r in records if isinstance(r, dict)]
    if not records:
        return {}
    measured = records[max(warmup_steps, 0) :] or records
    out: dict[str, float] = {
        "summary/steps": float(len(records)),
        "summary/steps_measured": float(len(measured)),
    }

    if times := _values(measured, "perf/step_time_s"):
        out["summary/step_time_median_s"] = statistics.median(times)
        out["summary/step_time_mean_s"] = statistics.fmean(times)
    for key, name in (
        ("perf/samples_per_s", "summary/samples_per_s_mean"),
        ("perf/tokens_per_s", "summary/tokens_per_s_mean"),
        ("perf/tflops_per_device", "summary/tflops_per_device_mean"),
        ("perf/mfu", "summary/mfu_mean"),
    ):
        if values := _values(measured, key):
            out[name] = statistics.fmean(values)

    if peaks := _values(records, "memory/peak_bytes_max"):
        out["summary/peak_bytes_max"] = max(peaks)
    if predicted := _values(records, "memory/predicted_bytes"):
        out["summary/predicted_bytes"] = predicted[-1]
        if peaks and predicted[-1] > 0:
            # > 1: the planner under-estimated memory; the ratio is what calibration tracks.
            out["summary/memory_ratio"] = max(peaks) / predicted[-1]
    if losses := _values(records, "train/loss"):
        out["summary/final_loss"] = losses[-1]
    return out
