"""Real data that every installation already has, so a first run learns something real with no
download: the text of Python's own standard library as byte tokens (GPT, ERNIE), and
scikit-learn's 8×8 handwritten digits (ResNet; 1,797 scans from UCI, shipped inside the package).

Sample i is a pure function of i (as for every source): a fixed permutation of the corpus' windows
or images, so any layout sees the same samples.
"""

from __future__ import annotations

import math
import sysconfig
from functools import cache
from pathlib import Path

import numpy as np
import torch

TEXT_BYTES = 2_000_000  # enough text that 30-300 steps of the tiny recipes never repeat a window
SPACE = 32  # the byte of " ": word boundaries for ERNIE's whole-word masking
DIGIT_CLASSES = 10


def _spread(n: int) -> tuple[int, int]:
    """An affine permutation i -> (a·i + c) mod n that scatters consecutive samples."""
    a = max(1, int(n * 0.6180339887)) | 1
    while math.gcd(a, n) != 1:
        a += 1
    return a, n // 3


@cache
def stdlib_text(max_bytes: int = TEXT_BYTES) -> np.ndarray:
    """Bytes of the standard library's top-level modules, in name order, up to `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python sources under {root} (a stripped Python install?)")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


class BundledText:
    """Windows of seq_len + 1 byte tokens from the standard library's source text."""

    space_id = SPACE

    def __init__(self, seq_len: int):
        self.tokens = stdlib_text()
        self.seq_len = seq_len
        self.num_samples = (len(self.tokens) - 1) // seq_len
        self._a, self._c = _spread(self.num_samples)

    def sequences(self, indices: np.ndarray, length: int) -> np.ndarray:
        windows = (np.asarray(indices, dtype=np.int64) * self._a + self._c) % self.num_samples
        return np.stack(
            [self.tokens[w * self.seq_len : w * self.seq_len + length].astype(np.int64) for w in windows]
        )

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        seq = torch.from_numpy(self.sequences(indices, self.seq_len + 1))
        return {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()}


@cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.float32), d.target.astype(np.int64)


class BundledDigits:
    """scikit-learn's digits (8×8, 0-16 ink), scaled to about [-1, 1], enlarged to image_size by
    repeating pixels and copied into every channel."""

    def __init__(self, image_size: int, channels: int):
        self.images, self.labels = _digits()
        self.size, self.channels = image_size, channels
        self.num_samples = len(self.labels)
        self._a, self._c = _spread(self.num_samples)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        rows = (np.asarray(indices, dtype=np.int64) * self._a + self._c) % self.num_samples
        x = torch.from_numpy(self.images[rows] / 8.0 - 1.0).unsqueeze(1)
        x = torch.nn.functional.interpolate(x, size=(self.size, self.size), mode="nearest")
        x = x.expand(-1, self.channels, -1, -1).contiguous()
        return {"images": x, "labels": torch.from_numpy(self.labels[rows])}
