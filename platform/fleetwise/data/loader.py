"""Per-rank slices of each step's global batch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from fleetwise.data import SampleSource


@dataclass(frozen=True)
class StepBatches:
    source: SampleSource
    global_batch_size: int
    micro_batch_size: int
    num_microbatches: int
    dp_rank: int = 0
    dp_size: int = 1

    def indices(self, step: int) -> np.ndarray:
        """Global sample indices this rank reads at `step` (1-based), in micro-batch order."""
        per_rank = self.micro_batch_size * self.num_microbatches
        assert per_rank * self.dp_size == self.global_batch_size
        start = (step - 1) * self.global_batch_size + self.dp_rank * per_rank
        return np.arange(start, start + per_rank, dtype=np.int64) % self.source.num_samples

    def microbatches(self, step: int) -> list[dict[str, torch.Tensor]]:
        whole = self.source.batch(self.indices(step))
        b = self.micro_batch_size
        return [{k: v[i * b : (i + 1) * b] for k, v in whole.items()} for i in range(self.num_microbatches)]

    def each_microbatch(self, step: int) -> Iterator[dict[str, torch.Tensor]]:
        """The same micro-batches as `microbatches`, read one at a time: a source that draws on
        the device holds one micro-batch there at a time, as a GPU job holds one copied from the
        host (the plan's inputs)."""
        indices, b = self.indices(step), self.micro_batch_size
        for i in range(self.num_microbatches):
            yield self.source.batch(indices[i * b : (i + 1) * b])

    def whole(self, step: int) -> dict[str, torch.Tensor]:
        """All of this rank's micro-batches stacked (a pipeline schedule splits them itself)."""
        return self.source.batch(self.indices(step))
