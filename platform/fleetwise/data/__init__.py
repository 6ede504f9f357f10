"""Data: deterministic sample sources and the per-rank slicing of global batches.

A source maps *global sample indices* to tensors, so every layout sees exactly the same samples:
step k uses indices [k·G, (k+1)·G) (mod the source size) and data-parallel rank r of D takes
the r-th contiguous slice of G/D of them, in micro-batches. Every rank therefore gets the same
number of batches, every step (unequal counts would hang the last collective).

This package holds what the families share: the per-rank slicing (`loader`), token sources
(`tokens`), the bundled corpora (`bundled`) and the tokenizer (`tokenize_text`). A family's own
sources live with it (`fleetwise.families.<name>.data`: ERNIE's masking, ResNet's images, CTR's
click logs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:  # not at run time: the launcher reads a source's index without torch (data/jsonl.py)
    import torch


class SampleSource(Protocol):
    """Global sample indices -> a batch (dict of stacked tensors). A source that can draw its
    batches on the device has `to(device)` (ResNet's synthetic images); a GPU job's trainer calls it."""

    num_samples: int

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]: ...
