"""Image sources for ResNet: synthetic class prototypes, .npz arrays, and class folders (the\nbundled digits, which ship with the package, are shared data: `fleetwise.data.bundled`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


class SyntheticImages:
    """Each class has a fixed random prototype image; a sample is its class prototype plus noise,
    so a classifier can learn the task and its loss falls.

    Everything random is drawn once, from the seed: the prototypes and a bank of Gaussian noise
    (`NOISE_BANKS` images' worth). A sample's label and the window of the bank that is its noise
    come from a hash of (seed, index): a batch is then one gather of windows and one add, on
    whatever device the source is on (`to`, which the trainer calls with a GPU job's device), so
    a GPU run measures the model, not the data: drawing each sample with numpy took ~3 ms per
    224x224 image, on the host, every step. The same seed and index give the same sample on
    every device and layout (the values are the host's, copied; the add is exact)."""

    NOISE_BANKS = 4  # the noise bank holds this many images' worth: windows at any offset in it

    def __init__(self, num_classes: int, image_size: int, channels: int, seed: int, num_samples: int):
        self.num_classes, self.size, self.channels = num_classes, image_size, channels
        self.seed, self.num_samples = seed, num_samples
        shape = (num_classes, channels, image_size, image_size)
        self.prototypes = torch.from_numpy(
            np.random.default_rng([seed, 2**31]).standard_normal(shape).astype(np.float32)
        )
        self.pixels = channels * image_size * image_size
        self.noise = torch.from_numpy(
            np.random.default_rng([seed, 2**31 + 1]).standard_normal(
                self.NOISE_BANKS * self.pixels, dtype=np.float32
            )
        )

    def to(self, device: torch.device) -> SyntheticImages:
        """This source, drawing its batches on `device` (the prototypes and the noise bank move once)."""
        self.prototypes, self.noise = self.prototypes.to(device), self.noise.to(device)
        return self

    def draws(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's label and the offset of its noise window in the bank (host integers)."""
        key = _mix(
            np.asarray(indices, dtype=np.uint64) ^ _mix(np.full(len(indices), self.seed, dtype=np.uint64))
        )
        labels = (key % np.uint64(self.num_classes)).astype(np.int64)
        offsets = (_mix(key) % np.uint64(len(self.noise) - self.pixels + 1)).astype(np.int64)
        return labels, offsets

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        labels, offsets = self.draws(indices)
        c, s = self.channels, self.size
        # views into the bank and the prototypes, gathered by one copy each (no host data)
        noise = torch.stack([self.noise[o : o + self.pixels] for o in offsets.tolist()]).view(-1, c, s, s)
        images = noise.add_(torch.stack([self.prototypes[label] for label in labels.tolist()]), alpha=0.5)
        return {"images": images, "labels": torch.from_numpy(labels)}


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (Steele et al. 2014): a bijection of uint64 that scatters every input
    bit over the output (arithmetic modulo 2^64)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(2**64 - 1)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


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
