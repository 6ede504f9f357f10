"""The overhead suite's hand-written loop steps with the malloc settings a fleetwise rank steps with
(README, `make bench` overhead): without them glibc faults in every tensor of a few MiB each step
and the baseline is slower for a reason that is not fleetwise's (d=768, 1 process: 0.918)."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

from helpers.repo import REPO

from fleetwise.launcher.torchrun import HOST_MALLOC
from fleetwise.runtime.hostmalloc import STEADY_MMAP_THRESHOLD, STEADY_TRIM_THRESHOLD

sys.path.insert(0, str(REPO / "scripts"))  # bench.py imports its sibling bench_slices
spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_the_plain_loop_steps_with_a_fleetwise_ranks_malloc_settings(tmp_path):
    for ranks in (1, 2):
        cmd, env = bench.Bench.plain_job(
            SimpleNamespace(env={"X": "1"}), tmp_path / "c.yaml", ranks, tmp_path / "o"
        )
        assert env["MALLOC_MMAP_THRESHOLD_"] == str(STEADY_MMAP_THRESHOLD)
        assert env["MALLOC_TRIM_THRESHOLD_"] == str(STEADY_TRIM_THRESHOLD)
        assert env["MALLOC_ARENA_MAX"] == HOST_MALLOC["MALLOC_ARENA_MAX"]
        assert env["X"] == "1" and ("torch.distributed.run" in cmd) == (ranks > 1)
