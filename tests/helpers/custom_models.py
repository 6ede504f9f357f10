"""Users' own modules and datasets for the custom-model tests (model=custom): a Hugging Face-style
model whose forward returns the loss, and the bad inputs validate must explain."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class NotAModule:
    def __init__(self, **_):
        pass


class WithLoss(nn.Module):
    """forward(x, y) returns an object with `.loss` (the Hugging Face convention)."""

    def __init__(self, features: int = 16, classes: int = 4):
        super().__init__()
        self.lin = nn.Linear(features, classes)

    def forward(self, x, y):
        return {"loss": nn.functional.cross_entropy(self.lin(x), y), "logits": None}


class OwnParameter(nn.Module):
    """A parameter created in __init__ with no reset_parameters to set it again."""

    def __init__(self, features: int = 16, classes: int = 4):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features))
        self.lin = nn.Linear(features, classes)

    def forward(self, x):
        return self.lin(x * self.scale)


class TupleItems(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(16), torch.tensor(0)


def per_sample_loss(logits, y):
    return nn.functional.cross_entropy(logits, y, reduction="none")
