"""Image sources for ResNet: synthetic class prototypes, .npz arrays, and class folders (the\nbundled digits, which ship with the package, are shared data: `fleetwise.data.bundled`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fleetwise.data.tokens import sample_rng

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


class SyntheticImages:
    """Each class has a fixed random prototype image; a sample is its class prototype plus noise,
    so a classifier can learn the task and its loss falls."""

    def __init__(self, num_classes: int, image_size: int, channels: int, seed: int, num_samples: int):
        self.num_classes, self.size, self.channels = num_classes, image_size, channels
        self.seed, self.num_samples = seed, num_samples
        shape = (num_classes, channels, image_size, image_size)
        self.prototypes = np.random.default_rng([seed, 2**31]).standard_normal(shape).astype(np.float32)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        images = np.empty((len(indices), self.channels, self.size, self.size), dtype=np.float32)
        labels = np.empty(len(indices), dtype=np.int64)
        for row, idx in enumerate(indices):
            rng = sample_rng(self.seed, idx)
            labels[row] = rng.integers(self.num_classes)
            noise = rng.standard_normal(images.shape[1:], dtype=np.float32)
            images[row] = 0.5 * self.prototypes[labels[row]] + noise
        return {"images": torch.from_numpy(images), "labels": torch.from_numpy(labels)}


def _normalise(images_uint8: np.ndarray) -> torch.Tensor:
    """(N, H, W, C) uint8 -> (N, C, H, W) float in about [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(images_uint8)).permute(0, 3, 1, 2).float()
    return x.div_(127.5).sub_(1.0).contiguous()


class ImageArray:
    """An .npz with `images` (N, H, W, C) uint8 and `labels` (N,)."""

    def __init__(self, path: str | Path):
        with np.load(path, allow_pickle=False) as npz:
            self.images, self.labels = npz["images"], npz["labels"].astype(np.int64)
        self.num_samples = len(self.labels)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return {"images": _normalise(self.images[indices]), "labels": torch.from_numpy(self.labels[indices])}


class ImageFolder:
    """<root>/<class>/*.png|jpg; classes in sorted folder order, images resized to image_size."""

    def __init__(self, root: str | Path, image_size: int):
        root = Path(root)
        classes = sorted(p for p in root.iterdir() if p.is_dir())
        self.files = [
            (f, c)
            for c, d in enumerate(classes)
            for f in sorted(d.iterdir())
            if f.suffix.lower() in IMAGE_SUFFIXES
        ]
        self.size = image_size
        self.num_samples = len(self.files)

    def _load(self, path: Path) -> np.ndarray:
        from PIL import Image

        with Image.open(path) as im:
            return np.asarray(im.convert("RGB").resize((self.size, self.size)), dtype=np.uint8)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        images = np.stack([self._load(self.files[i][0]) for i in indices])
        labels = np.array([self.files[i][1] for i in indices], dtype=np.int64)
        return {"images": _normalise(images), "labels": torch.from_numpy(labels)}
