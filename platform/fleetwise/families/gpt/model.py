"""GPT: a decoder-only causal language model (Radford et al. 2019; Brown et al. 2020).

tokens -> token + learned position embeddings -> pre-LN blocks -> final LN -> LM head (untied, so a
pipeline can put the embedding and the head on different stages). Blocks live in a ModuleDict keyed
by layer index, so parameter names stay the same however the model is cut into pipeline stages
(checkpoints reshard across layouts).
"""

from __future__ import annotations

import torch
from torch import nn

from fleetwise.families.gpt.schema import GPTModel
from fleetwise.models.init import transformer_rule
from fleetwise.models.transformer import DecoderLM, PreLNBlock


class GPTEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq_len: int, dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)
        self.drop = nn.Dropout(dropout)
        self.seq = None  # context parallelism: the true positions of this rank's chunks

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        if self.seq is None:
            positions = torch.arange(s, device=tokens.device)
        else:
            positions = self.seq.positions(s, tokens.device)
        return self.drop(self.tok(tokens) + self.pos(positions))


class GPT(DecoderLM):
    # the model contract (fleetwise.models.contract): the ends and the forward are DecoderLM's

    def __init__(self, cfg: GPTModel):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed: nn.Module | None = GPTEmbedding(cfg.padded_vocab_size, h, cfg.seq_len, cfg.dropout)
        self.layers = nn.ModuleDict(
            {
                str(i): PreLNBlock(h, cfg.num_attention_heads, cfg.ffn_hidden_size, cfg.dropout)
                for i in range(cfg.num_layers)
            }
        )
        self.norm: nn.Module | None = nn.LayerNorm(h)
        self.output: nn.Module | None = nn.Linear(h, cfg.padded_vocab_size, bias=False)
        # initial values: fleetwise.models.init (drawn per parameter, after sharding)
        self.init_rule = transformer_rule(cfg.init_std, cfg.num_layers)
