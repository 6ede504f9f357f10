"""Your own map-style Dataset as a fleetwise sample source: global sample indices -> a batch.

Items are dicts of tensors; a batch stacks each key. Index i of the job's stream is item
i mod len(dataset), so every layout sees the same samples (fleetwise.data).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class DatasetSource:
    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.num_samples = len(dataset)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        items = [self.dataset[int(i) % self.num_samples] for i in indices]
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def source(_m: Any, d: Any) -> DatasetSource:
    from hydra.utils import instantiate

    from fleetwise.families.custom.targets import ensure_cwd_importable

    ensure_cwd_importable()
    return DatasetSource(instantiate(d.dataset))
