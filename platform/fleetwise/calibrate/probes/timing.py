"""How the probes time things: best or median of repeated runs, interleaved twins, the slowest rank."""

from __future__ import annotations

import statistics
import time

import torch

# The share of each probe's repetitions that runs (`fleetwise calibrate --quick`: QUICK). Fewer
# repetitions give the same keys from fewer samples: noisier, never a different measurement.
QUICK = 0.2
MIN_REPS = 3  # a median or a best needs a few samples, whatever the share
_share = 1.0


def set_share(share: float) -> None:
    """Run `share` (0 < share <= 1) of every probe's repetitions from now on."""
    global _share
    _share = share


def repetitions(reps: int) -> int:
    """`reps` scaled by the current share, at least MIN_REPS (and never more than asked)."""
    return min(reps, max(MIN_REPS, round(reps * _share)))


def timed(fn, reps: int, sync=lambda: None, typical: bool = False) -> float:
    """Fastest (or, `typical`, the median) of `reps` runs of `fn` (scaled: `repetitions`), in seconds,
    after one warm-up."""
    reps = repetitions(reps)
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    if typical:
        return statistics.median(times)
    return min(times)  # best of reps: on a shared machine noise only ever slows a run down


def interleaved(fns, reps: int) -> list[float]:
    """Median seconds of each of `fns`, run in turn (a, b, a, b, ...) after one warm-up each: a probe
    that subtracts one timing from another (a variant against its plain twin) must see a shared
    machine's slow spells on both sides alike, or the difference measures the noise. `reps` is
    scaled (`repetitions`)."""
    reps = repetitions(reps)
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def slowest(seconds: float) -> float:
    """The largest of every rank's value: a collective step lasts as long as its slowest rank."""
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)
