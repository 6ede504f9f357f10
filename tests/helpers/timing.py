"""The README's time promises, guarded as stated, with ONE allowance for a loaded machine.

At idle (1-minute load average below IDLE_LOAD) a promise of S seconds is held on wall time and on
the CPU time the work took. On a busy machine wall time means nothing (the work waits for a core),
and the same work takes more CPU time too (shared caches and cores: up to 1.5x measured on this
2-core machine at load 9): there the bound is LOADED_FACTOR x S on CPU time only -- still far below
what the promises guard against (importing torch or mlflow on the way, ~2 s each; a search that
plans every layout).
"""

from __future__ import annotations

import os
import resource
import subprocess
import time
from dataclasses import dataclass

IDLE_LOAD = 0.5
LOADED_FACTOR = 2.0


def idle() -> bool:
    """Whether the machine is idle enough for wall time to be held to a promise."""
    return os.getloadavg()[0] < IDLE_LOAD


def has_a_free_core() -> bool:
    """Whether the machine has a core no one else is using (1-minute load average below its cores):
    where a measurement that subtracts two timings (calibrate's) can resolve its difference."""
    return os.getloadavg()[0] < (os.cpu_count() or 1)


@dataclass
class Timed:
    wall: float
    cpu: float  # user + system seconds of the work (a child's: the kernel's accounting of it)
    idle: bool  # the machine was idle when the work started

    def budget(self, promise_s: float) -> float:
        return promise_s if self.idle else promise_s * LOADED_FACTOR

    def within(self, promise_s: float) -> bool:
        """The work kept a promise of `promise_s` seconds, under the allowance above."""
        return self.cpu <= self.budget(promise_s) and (not self.idle or self.wall <= promise_s)

    def __str__(self) -> str:
        return f"{self.wall:.2f} s wall, {self.cpu:.2f} CPU-s ({'idle' if self.idle else 'busy'}, load {os.getloadavg()[0]:.2f})"


def run_timed(cmd: list[str], **kw) -> tuple[subprocess.CompletedProcess, Timed]:
    """subprocess.run(cmd, capture_output=True, text=True, **kw) with its wall and CPU time."""
    calm = idle()
    before, t = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    wall, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return r, Timed(wall, cpu, calm)


class timed_here:
    """`with timed_here() as t:` -- the block's wall time and this process's CPU time (all threads)."""

    def __enter__(self) -> Timed:
        self.t = Timed(0.0, 0.0, idle())
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self.t

    def __exit__(self, *exc) -> None:
        self.t.wall = time.perf_counter() - self._wall
        self.t.cpu = time.process_time() - self._cpu
