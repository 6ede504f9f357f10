"""Token windows with a rule to learn -- each sequence counts up by its own stride, modulo the
vocabulary -- as dicts of `input_ids` and `labels` (a transformers causal LM shifts the labels
itself). Seeded: every rank and every run reads the same items."""

import torch
from torch.utils.data import Dataset


class CountingTokens(Dataset):
    def __init__(self, n: int = 1024, seq_len: int = 16, vocab_size: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(vocab_size, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq_len)) % vocab_size

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
