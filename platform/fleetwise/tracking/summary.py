"""End-of-run summary metrics, computed from the per-step records of metrics.jsonl."""

from __future__ import annotations

import statistics

from fleetwise.rundir import Metric, Summary
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
        Summary.STEPS: float(len(records)),
        Summary.STEPS_MEASURED: float(len(measured)),
    }

    if times := _values(measured, Metric.STEP_TIME):
        out[Summary.STEP_TIME_MEDIAN] = statistics.median(times)
        out[Summary.STEP_TIME_MEAN] = statistics.fmean(times)
    for key, name in (
        (Metric.SAMPLES_PER_S, Summary.SAMPLES_PER_S),
        (Metric.TOKENS_PER_S, Summary.TOKENS_PER_S),
        (Metric.TFLOPS_PER_DEVICE, Summary.TFLOPS_PER_DEVICE),
        (Metric.MFU, Summary.MFU),
    ):
        if values := _values(measured, key):
            out[name] = statistics.fmean(values)

    if peaks := _values(records, Metric.PEAK_BYTES_MAX):
        out[Summary.PEAK_BYTES_MAX] = max(peaks)
    if predicted := _values(records, Metric.PREDICTED_BYTES):
        out[Summary.PREDICTED_BYTES] = predicted[-1]
        if peaks and predicted[-1] > 0:
            # > 1: the planner under-estimated memory; the ratio is what calibration tracks.
            out[Summary.MEMORY_RATIO] = max(peaks) / predicted[-1]
    if losses := _values(records, Metric.LOSS):
        out[Summary.FINAL_LOSS] = losses[-1]
    return out
