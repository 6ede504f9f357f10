"""How the probes time things: best or median of repeated runs, interleaved twins, the slowest rank."""

from __future__ import annotations

import statistics
import time

import torch


def timed(fn, reps: int, sync=lambda: None, typical: bool = False) -> float:
    """Fastest (or, `typical`, the median) of `reps` runs of `fn`, in seconds, after one warm-up."""
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
    machine's slow spells on both sides alike, or the difference measures the noise."""
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
