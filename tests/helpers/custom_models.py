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


class Attending(nn.Module):
    """A block of scaled-dot-product attention over the sample's 4 rows of 4 features (one head):
    on a CPU torch dispatches it to the CPU flash-attention kernel."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, h):
        return nn.functional.scaled_dot_product_attention(self.q(h), h, h)


class Attentive(nn.Module):
    """x [b, 16] seen as [b, 1 head, 4 rows, 4 features], two attention blocks, a linear head."""

    def __init__(self, features: int = 16, classes: int = 4):
        super().__init__()
        self.trunk = nn.ModuleList(Attending() for _ in range(2))
        self.head = nn.Linear(features, classes)

    def forward(self, x):
        h = x.view(x.shape[0], 1, 4, 4)
        for block in self.trunk:
            h = block(h)
        return self.head(h.flatten(1))


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
