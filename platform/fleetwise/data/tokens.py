"""Token sources for language models: synthetic sequences and memory-mapped token files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def sample_rng(seed: int, index: int) -> np.random.Generator:
    """A generator that depends only on (seed, global sample index)."""
    return np.random.default_rng([seed, int(index)])


class SyntheticTokens:
    """Deterministic sequences with learnable structure: each token is usually followed by a fixed
    successor (a random permutation of the vocabulary, drawn once from the data seed) and
    sometimes by a random token. A model lowers its loss quickly by learning the successor map, so
    a demo run visibly learns; the noise keeps the optimum away from zero."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, num_samples: int, noise: float = 0.15):
        self.vocab, self.seq_len, self.seed, self.num_samples, self.noise = (
            vocab_size,
            seq_len,
            seed,
            num_samples,
            noise,
        )
        self.successor = np.random.default_rng([seed, 2**31]).permutation(vocab_size)

    def sequences(self, indices: np.ndarray, length: int) -> np.ndarray:
        n = len(indices)
        start = np.empty(n, dtype=np.int64)
        noise = np.empty((n, length), dtype=bool)
        rand = np.empty((n, length), dtype=np.int64)
        for row, idx in enumerate(indices):
            rng = sample_rng(self.seed, idx)
            start[row] = rng.integers(self.vocab)
            noise[row] = rng.random(length) < self.noise
            rand[row] = rng.integers(self.vocab, size=length)
        out = np.empty((n, length), dtype=np.int64)
        out[:, 0] = start
        for i in range(1, length):
            out[:, i] = np.where(noise[:, i], rand[:, i], self.successor[out[:, i - 1]])
        return out

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        seq = torch.from_numpy(self.sequences(indices, self.seq_len + 1))
        return {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()}


class TokenFile:
    """A flat binary of token ids (see config/datafiles.py), memory-mapped; sample i is the i-th
    window of seq_len + 1 tokens, so each rank touches only the pages it reads."""

    def __init__(self, path: str | Path, seq_len: int):
        path = Path(path)
        meta = json.loads(path.with_suffix(".json").read_text())
        self.vocab_size = int(meta["vocab_size"])
        self.tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]).newbyteorder("<"), mode="r")
        self.seq_len = seq_len
        self.num_samples = (len(self.tokens) - 1) // seq_len
        self.space_id = meta.get("space_id")

    def sequences(self, indices: np.ndarray, length: int) -> np.ndarray:
        starts = indices * self.seq_len
        return np.stack([np.asarray(self.tokens[s : s + length], dtype=np.int64) for s in starts])

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        seq = torch.from_numpy(self.sequences(indices, self.seq_len + 1))
        return {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()}


def write_token_file(path: str | Path, tokens: np.ndarray, vocab_size: int, **meta) -> Path:
    """Write `<path>` (.bin) and its `.json` metadata; the dtype is the smallest that fits."""
    path = Path(path)
    dtype = "uint8" if vocab_size <= 256 else "uint16" if vocab_size <= 65536 else "uint32"
    np.asarray(tokens, dtype=np.dtype(dtype).newbyteorder("<")).tofile(path)
    info = {"dtype": dtype, "vocab_size": vocab_size, "num_tokens": int(len(tokens)), **meta}
    path.with_suffix(".json").write_text(json.dumps(info, indent=2))
    return path
