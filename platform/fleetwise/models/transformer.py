"""Transformer building blocks shared by GPT, ERNIE and Llama, and their language-model loss.

Plain nn.Modules with no parallel code: tensor parallelism is applied from outside with the
plans in each family's `tp_plan.py` (their shared parts: `models/tp_plan.py`). Attention keeps q, k and v as separate projections (a fused qkv weight
would be split across ranks in the wrong places by column parallelism) and infers the number of
local heads from the projection width, so the same code runs whole or sharded.

Context parallelism (runtime/context_parallel.py) reaches a model through one attribute, `seq`, of
the modules that must know where their tokens sit in the whole sequence -- attention and position
tables: None (the whole sequence is on this rank) unless the runtime set it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, causal: bool, dropout: float = 0.0):
        super().__init__()
        self.head_dim = hidden // heads
        self.causal = causal
        self.dropout = dropout
        self.wq = nn.Linear(hidden, hidden)
        self.wk = nn.Linear(hidden, hidden)
        self.wv = nn.Linear(hidden, hidden)
        self.wo = nn.Linear(hidden, hidden)
        self.seq = None  # context parallelism: this rank's SeqShard (runtime/context_parallel.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds num_heads / mp of them.
        q, k, v = (
            proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.wq, self.wk, self.wv)
        )
        if self.seq is not None:  # (validate refuses attention dropout with context parallelism)
            out = self.seq.attend(q, k, v, causal=self.causal)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=self.causal, dropout_p=self.dropout if self.training else 0.0
            )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)) (Shazeer 2020)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class PreLNBlock(nn.Module):
    """GPT-2/3 block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, causal=True, dropout=dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class PostLNBlock(nn.Module):
    """BERT/ERNIE block: ln(x + attn(x)), then ln(x + mlp(x)); bidirectional attention."""

    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float = 0.0):
        super().__init__()
        self.attn = Attention(hidden, heads, causal=False, dropout=dropout)
        self.ln1 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)
        self.ln2 = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.drop(self.attn(x)))
        return self.ln2(x + self.drop(self.mlp(x)))


class DecoderLM(nn.Module):
    """What GPT and Llama share: the model contract's ends (fleetwise.models.contract) and a forward
    through whichever of them this pipeline stage kept. A subclass builds `embed`, `layers` (a
    ModuleDict keyed by layer index), `norm` and `output`."""

    first_modules = ("embed",)  # kept only by the first pipeline stage
    last_modules = ("norm", "output")  # kept only by the last
    embed: nn.Module | None
    layers: nn.ModuleDict
    norm: nn.Module | None
    output: nn.Module | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] (first stage) or hidden states [b, s, h] -> logits [b, s, V] (last stage) or hidden."""
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; positions labelled -100 are ignored."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
