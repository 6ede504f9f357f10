"""Synthetic click logs: deterministic per global sample index, Zipf-skewed ids, a learnable label.

Sample i is a pure function of (data.seed, i): every value is drawn from a counter-based hash
(splitmix64) of the seed, a stream number and i, so any split of a global batch over trainers or
micro-batches sees exactly the same samples, in any order, with no generator state to carry.

- ids: field f draws a popularity rank from a Zipf(data.zipf_alpha) law truncated to the table's
  rows (inverse CDF), then maps the rank to a row id by a fixed bijection (an affine permutation of
  the rows) so popular ids are scattered over the id space as in hashed real logs, not all at the
  beginning of the table.
- dense: standard normal features.
- label: Bernoulli(sigmoid(teacher)) where the hidden teacher is a per-(field, id) weight plus a
  linear function of the dense features (scaled so that a model learns most of it in the tiny
  recipe's 30 steps: its loss falls about 40% below ln 2).

Batches of a run (`step` counts from 0): the global batch of step k is sample indices
[k·G, (k+1)·G) modulo data.num_samples; trainer (or data-parallel rank) t of T takes the
contiguous slice [t·G/T, (t+1)·G/T), in micro-batches of train.micro_batch_size.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fleetwise.config.data import DataConfig
from fleetwise.families.ctr import CTRModel

_U64 = np.uint64


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + _U64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


def _uniform(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """U[0, 1) per index, independent across (seed, stream)."""
    key = _splitmix(np.array([(seed * 1_000_003 + stream) & ((1 << 64) - 1)], dtype=_U64))[0]
    z = _splitmix(index.astype(_U64) ^ key)
    return (z >> _U64(11)).astype(np.float64) * 2.0**-53


def _normal(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """Standard normal per index (Box-Muller on two independent uniforms)."""
    u1 = _uniform(seed, 2 * stream, index)
    u2 = _uniform(seed, 2 * stream + 1, index)
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2 * np.pi * u2)


def _coprime_multiplier(n: int) -> int:
    a = max(1, int(n * 0.6180339887)) | 1
    while math.gcd(a, n) != 1:
        a += 1
    return a


class SyntheticClicks:
    """`batch(indices)` -> {"sparse_ids" [B, F] int64, "dense" [B, d] float32, "labels" [B] float32}."""

    # stream numbers keep the hashed draws of different quantities independent
    _IDS, _DENSE, _LABEL, _TEACHER_ID, _TEACHER_DENSE = 0, 1000, 2000, 3000, 4000

    def __init__(self, model_cfg: CTRModel, data_cfg: DataConfig) -> None:
        self.model_cfg, self.seed, self.alpha = model_cfg, data_cfg.seed, data_cfg.zipf_alpha
        self.num_samples = data_cfg.num_samples  # distinct samples before the stream repeats
        self._cdf: list[np.ndarray] = []
        self._perm: list[tuple[int, int]] = []
        for f, t in enumerate(model_cfg.sparse_tables):
            p = np.arange(1, t.num_embeddings + 1, dtype=np.float64) ** -self.alpha
            cdf = np.cumsum(p)
            self._cdf.append(cdf / cdf[-1])
            offset = int(_splitmix(np.array([self.seed + f], dtype=_U64))[0] % _U64(t.num_embeddings))
            self._perm.append((_coprime_multiplier(t.num_embeddings), offset))
        d = model_cfg.num_dense_features
        self._dense_w = _normal(self.seed, self._TEACHER_DENSE, np.arange(d)) * (1.0 / math.sqrt(max(d, 1)))

    def ids(self, field: int, indices: np.ndarray) -> np.ndarray:
        n = self.model_cfg.sparse_tables[field].num_embeddings
        u = _uniform(self.seed, self._IDS + field, indices)
        rank = np.minimum(np.searchsorted(self._cdf[field], u, side="right"), n - 1)
        a, c = self._perm[field]
        return (rank.astype(np.int64) * a + c) % n

    def teacher_weight(self, field: int, ids: np.ndarray) -> np.ndarray:
        """The hidden per-id click propensity of a field."""
        return _normal(self.seed, self._TEACHER_ID + field, ids)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        indices = np.asarray(indices, dtype=np.int64)
        fields = len(self.model_cfg.sparse_tables)
        ids = (
            np.stack([self.ids(f, indices) for f in range(fields)], 1)
            if fields
            else np.zeros((len(indices), 0))
        )
        d = self.model_cfg.num_dense_features
        dense = (
            np.stack([_normal(self.seed, self._DENSE + j, indices) for j in range(d)], 1)
            if d
            else np.zeros((len(indices), 0))
        )
        teacher = sum(self.teacher_weight(f, ids[:, f]) for f in range(fields)) / math.sqrt(max(fields, 1))
        logit = 1.5 * teacher + 6.0 * (dense @ self._dense_w) - 0.5
        labels = (_uniform(self.seed, self._LABEL, indices) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return {
            "sparse_ids": torch.from_numpy(ids.astype(np.int64)),
            "dense": torch.from_numpy(dense.astype(np.float32)),
            "labels": torch.from_numpy(labels),
        }


def step_indices(step: int, global_batch_size: int, num_samples: int) -> np.ndarray:
    """Sample indices of the global batch of optimizer step `step` (from 0)."""
    return np.arange(step * global_batch_size, (step + 1) * global_batch_size, dtype=np.int64) % num_samples


def rank_micro_batches(
    step: int, rank: int, num_ranks: int, global_batch_size: int, micro_batch_size: int, num_samples: int
) -> list[np.ndarray]:
    """The micro-batches (sample indices) of data-parallel rank `rank` of `num_ranks` at `step`."""
    per_rank = global_batch_size // num_ranks
    mine = step_indices(step, global_batch_size, num_samples)[rank * per_rank : (rank + 1) * per_rank]
    return [mine[i : i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
