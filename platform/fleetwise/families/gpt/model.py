"""GPT: a decoder-only causal language model (Radford et al. 2019; Brown et al. 2020).

tokens -> token + learned position embeddings -> pre-LN blocks -> final LN -> LM head (untied, so a
pipeline can put the embedding and the head on different stages). Blocks live in a ModuleDict keyed
by layer index, so parameter names stay the same however the model is cut into pipeline stages
(checkpoints reshard across layouts).

With `model.moe`, the blocks it names have the mixture of experts Llama uses (fleetwise.models.moe:
a router and SwiGLU experts of width moe.expert_ffn_size, default ffn_hidden_size) in place of
their GELU MLP; attention, norms and embeddings stay GPT's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fleetwise.families.gpt.schema import GPTModel
from fleetwise.families.moe import expert_width, is_moe_layer
from fleetwise.models.init import transformer_rule
from fleetwise.models.moe import GroupedExperts, MoE
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
        self.layers = nn.ModuleDict({str(i): block(cfg, i) for i in range(cfg.num_layers)})
        self.norm: nn.Module | None = nn.LayerNorm(h)
        self.output: nn.Module | None = nn.Linear(h, cfg.padded_vocab_size, bias=False)
        # initial values: fleetwise.models.init (drawn per parameter, after sharding)
        self.init_rule = gpt_rule(cfg.init_std, cfg.num_layers)


def block(cfg: GPTModel, layer: int) -> PreLNBlock:
    """GPT's pre-LN block; its MLP the mixture of experts in the blocks model.moe names."""
    b = PreLNBlock(cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size, cfg.dropout)
    if is_moe_layer(cfg.moe, layer):
        b.mlp = MoE(cfg.hidden_size, cfg.moe, expert_width(cfg.moe, cfg.ffn_hidden_size))
    return b


def gpt_rule(std: float, num_layers: int):
    """GPT-2's initialisation (transformer_rule); the experts' stacked weights N(0, std) too, their
    down projections (w2) and the shared experts' scaled by 1/sqrt(2·layers) like fc2 (residual
    outputs); the routers' linear and balancing bias as any linear and bias."""
    dense = transformer_rule(std, num_layers)

    def rule(mname: str, module: nn.Module, attr: str, shape, g: torch.Generator) -> torch.Tensor:
        if isinstance(module, GroupedExperts):
            scale = 1 / math.sqrt(2 * num_layers) if attr == "w2" else 1.0
            return torch.randn(shape, generator=g) * (std * scale)
        if mname.endswith("mlp.shared.down"):
            return torch.randn(shape, generator=g) * (std / math.sqrt(2 * num_layers))
        return dense(mname, module, attr, shape, g)

    return rule
