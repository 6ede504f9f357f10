"""A seeded toy classification set: items are dicts of tensors (README "Your own model")."""

import torch
from torch.utils.data import Dataset


class Blobs(Dataset):
    def __init__(self, n: int = 1024, features: int = 16, classes: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(classes, (n,), generator=g)
        centers = torch.randn(classes, features, generator=g) * 2
        self.x = centers[self.y] + torch.randn(n, features, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}
