"""A small residual MLP classifier: your own nn.Module, as fleetwise trains it (README "Your own model")."""

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, features: int = 16, dim: int = 32, depth: int = 4, classes: int = 4):
        super().__init__()
        self.embed = nn.Linear(features, dim)
        self.trunk = nn.ModuleList(Block(dim, 4 * dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.trunk:
            x = block(x)
        return self.head(x)


def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y)
