"""Micro-batch sampling is taken only where it runs fewer micro-batches than the job's own steps
(dryrun/sampling.py `cheaper`): three steps of nb, na, nb against `steps` steps of n."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fleetwise.dryrun.sampling import sampled_counts

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
