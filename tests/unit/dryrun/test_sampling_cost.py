"""Micro-batch sampling is taken only where it runs fewer micro-batches than the job's own steps
(dryrun/sampling.py `cheaper`): three steps of nb, na, nb (DDP four: nb, nb, na, nb) against `steps` steps of n."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fleetwise.dryrun.sampling import sampled_counts, sampled_steps

NO_PIPELINE = SimpleNamespace(model=SimpleNamespace(schedule=None))


@pytest.mark.parametrize(
    ("n", "steps", "expected"),
    [
        (1, 2, None),
        (4, 2, None),  # 4 + 3 + 4 = 11 micro-batches sampled against 2 x 4 = 8 run
        (5, 2, None),  # 11 against 10
        (6, 2, (3, 4)),  # 11 against 12
        (192, 2, (3, 4)),
        (4, 3, (3, 4)),  # 11 against 12
    ],
)
def test_sampling_without_a_pipeline_only_where_it_is_cheaper(n, steps, expected):
    assert sampled_counts(NO_PIPELINE, n, steps) == expected


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (7, None),  # DDP: 4 + 4 + 3 + 4 = 15 sampled against 2 x 7 = 14 run
        (8, (3, 4)),  # 15 against 16
    ],
)
def test_a_ddp_job_samples_one_step_more_for_its_bucket_rebuild(n, expected):
    """DDP rebuilds its buckets in the second step: that step runs nb micro-batches, and the two
    steady steps after it (na, nb) are the ones scaled (tests/integration/test_planner_vs_dryrun.py
    dp2_ddp_wide_8mb holds the result to --exact)."""
    assert sampled_counts(NO_PIPELINE, n, 2, ddp=True) == expected
    assert sampled_steps((3, 4), ddp=True) == [4, 4, 3, 4]
    assert sampled_steps((3, 4), ddp=False) == [4, 3, 4]
