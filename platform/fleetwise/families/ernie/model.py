"""ERNIE: a bidirectional Transformer encoder pre-trained by masked language modelling with
knowledge masking (Sun et al. 2019, "ERNIE: Enhanced Representation through Knowledge
Integration"): instead of single tokens, whole words, phrases and entities are masked together, so
the model must recover a unit from its context. The masking itself lives in `data.py` beside this
module; the model is the BERT-shaped encoder plus the MLM head.
"""

from __future__ import annotations

import torch
from torch import nn

from fleetwise.families.ernie.schema import ERNIEModel
from fleetwise.models.init import transformer_rule
from fleetwise.models.transformer import PostLNBlock


class ERNIEEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq_len: int, type_vocab: int, dropout: float = 0.0):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)
        self.segment = nn.Embedding(type_vocab, hidden)  # not `type`: nn.Module.type() exists
        self.norm = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.norm(self.word(tokens) + self.pos(positions) + self.segment(token_types)))


class MLMHead(nn.Module):
    """BERT's prediction head: dense + GELU + LN, then a decoder to the vocabulary (with bias)."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(nn.functional.gelu(self.dense(h), approximate="tanh")))


class ERNIE(nn.Module):
    first_modules = ("embed",)
    last_modules = ("head",)

    def __init__(self, cfg: ERNIEModel):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed: nn.Module | None = ERNIEEmbedding(
            cfg.padded_vocab_size, h, cfg.seq_len, cfg.type_vocab_size, cfg.dropout
        )
        self.layers = nn.ModuleDict(
            {
                str(i): PostLNBlock(h, cfg.num_attention_heads, cfg.ffn_hidden_size, cfg.dropout)
                for i in range(cfg.num_layers)
            }
        )
        # Logits for every position (as BERT/ERNIE implementations do); the loss reads only the
        # masked ones, labelled in the data.
        self.head: nn.Module | None = MLMHead(h, cfg.padded_vocab_size)
        # initial values: fleetwise.models.init (drawn per parameter, after sharding)
        self.init_rule = transformer_rule(cfg.init_std, cfg.num_layers)

    def forward(self, x: torch.Tensor, token_types: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x, token_types) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.head is not None else h
