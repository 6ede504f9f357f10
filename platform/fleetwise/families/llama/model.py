"""Llama 3 (Grattafiori et al. 2024, "The Llama 3 Herd of Models"; Meta's reference llama/model.py)
and the models of its shape (Qwen 3: q/k RMSNorm), as a plain nn.Module.

tokens -> token embedding -> pre-norm blocks [x + attn(rms(x)); x + swiglu(rms(x))] -> RMSNorm ->
LM head (tied to the embedding or not). No biases anywhere, no dropout, no learned positions:
rotary embeddings turn q and k by their position inside attention.

Conventions chosen so that a Hugging Face `LlamaForCausalLM` / `Qwen3ForCausalLM` state dict maps
onto this model by a name table alone (families/llama/hf.py, expected_tensors): the rotary embedding
rotates the two halves of each head (`rotate_half`, the convention of Hugging Face's checkpoints),
not interleaved pairs (Meta's original), so q and k weights need no permutation; RMSNorm computes
in fp32 and casts back before the weight, as Hugging Face's does; the vocabulary is not padded.

Parallel code stays outside (the tensor-parallel plan: tp_plan.py): attention infers its local head
counts from the projections' widths, so the same code runs whole or split over mp ranks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fleetwise.families.llama.schema import LlamaModel, RopeScaling
from fleetwise.families.moe import expert_width, is_moe_layer
from fleetwise.models.moe import GroupedExperts, MoE, Router
from fleetwise.models.transformer import DecoderLM, SwiGLU


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight (Zhang & Sennrich 2019), computed in fp32 and cast back to
    the input's dtype before the weight (as Hugging Face's LlamaRMSNorm: bf16 runs normalise in fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> list[float]:
    """RoPE's per-pair frequencies θ^(-2i/d) (Su et al. 2021), with Llama 3.1's "llama3" scaling:
    wavelengths longer than L/low_freq_factor are slowed down by `factor`, shorter than
    L/high_freq_factor kept, and the band between interpolated smoothly. Computed once, on the
    host, in fp32 in the order Hugging Face computes them (`_compute_llama3_parameters`), so the
    two agree to the bit; a Python list, so the model holds no buffer (DDP would broadcast it
    every step) and every rank and pipeline stage rebuilds it identically."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv = 1.0 / (theta**exponents)
    if scaling is not None:
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv.tolist()


def rotary_tables(
    inv_freq: list[float], seq_len: int, like: torch.Tensor, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position × frequency, [seq_len, head_dim] (each frequency twice: one per half);
    with `positions` [b, s] (packed documents: each restarts at 0), [b, 1, s, head_dim]."""
    freq = torch.tensor(inv_freq, dtype=torch.float32, device=like.device)
    if positions is None:
        angles = torch.arange(seq_len, device=like.device, dtype=torch.float32)[:, None] * freq
    else:
        angles = positions.to(device=like.device, dtype=torch.float32)[:, None, :, None] * freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask of packed documents, [b, 1, s, s] (True: may attend): a token
    sees the earlier tokens of its own document only. A document starts where its position is 0."""
    doc = (positions == 0).cumsum(-1)
    s = positions.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each (x_i, x_{i+d/2}) pair of every head by its angle: x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    """Causal grouped-query attention: a query heads, kv key/value heads, each kv head serving a/kv
    query heads (SDPA's enable_gqa: no copy of k and v per query head)."""

    def __init__(self, cfg: LlamaModel, inv_freq: list[float]):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_width
        self.head_dim = d
        self.gqa = cfg.num_kv_heads != cfg.num_attention_heads
        self.inv_freq = inv_freq  # a list, not a buffer (see inverse_frequencies)
        self.wq = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.wk = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.wv = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.wo = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        # Qwen 3: RMSNorm over each head's width, one weight shared by the heads, before RoPE
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        # context parallelism: this rank's SeqShard (runtime/context_parallel.py): rotary angles of
        # the chunks' true positions, attention over the whole sequence
        self.seq = None

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """positions [b, s]: packed documents (data=jsonl): rotary positions restart per document,
        and an explicit block-diagonal causal mask (`document_mask`) keeps attention inside each;
        SDPA with a boolean mask (FlexAttention would skip the masked blocks, but needs compile to
        be fast and runs eagerly on a CPU only with a warning). None: one causal sequence.
        Context parallel: positions are this rank's chunks' and documents the whole rows' document
        ids (SeqShard.shard_batch), the mask built by the SeqShard's attention."""
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a/mp query and kv/mp kv heads
        q, k, v = (proj(x).view(b, s, -1, self.head_dim) for proj in (self.wq, self.wk, self.wv))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.seq is not None:
            at = self.seq.positions(s, q.device)[None] if positions is None else positions
            cos, sin = rotary_tables(self.inv_freq, s, q, at)
            q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
            out = self.seq.attend(q, k, v.transpose(1, 2), causal=True, documents=documents)
            return self.wo(out.transpose(1, 2).reshape(b, s, -1))
        cos, sin = rotary_tables(self.inv_freq, s, q, positions)
        q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
        mask = None if positions is None else document_mask(positions.to(q.device))
        out = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), attn_mask=mask, is_causal=mask is None, enable_gqa=self.gqa
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """Pre-norm block: x + attn(rms(x)), then x + mlp(rms(x)); the MLP is a mixture of experts in
    the blocks model.moe names (fleetwise.models.moe)."""

    def __init__(self, cfg: LlamaModel, inv_freq: list[float], layer: int):
        super().__init__()
        h = cfg.hidden_size
        self.ln1 = RMSNorm(h, cfg.rms_norm_eps)
        self.attn = Attention(cfg, inv_freq)
        self.ln2 = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(h, cfg.moe, expert_width(cfg.moe, cfg.ffn_hidden_size))
            if is_moe_layer(cfg.moe, layer)
            else SwiGLU(h, cfg.ffn_hidden_size)
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        # positions by keyword: the tensor-parallel plan lays out the attention's positional input only
        x = x + self.attn(self.ln1(x), positions=positions, documents=documents)
        return x + self.mlp(self.ln2(x))


class TokenEmbedding(nn.Module):
    """The token table, in a module of its own so that sequence parallelism can re-lay its output
    (tp_plan.py) apart from the vocabulary-parallel lookup."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens)


class TiedHead(nn.Module):
    """The LM head of a tied model: logits = h · Eᵀ with the token embedding's weight E, read from
    the embedding module at every call (the weight has one owner: checkpoints, initialisation,
    FSDP and the optimizer see it once, and an allocated or sharded copy is the one read here)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self._embedding = (embedding,)  # a tuple, not an attribute: the embedding is not a submodule here

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self._embedding[0].weight)


class Llama(DecoderLM):
    # the model contract (fleetwise.models.contract): the ends and the forward are DecoderLM's

    def __init__(self, cfg: LlamaModel):
        super().__init__()
        self.cfg = cfg
        h, v = cfg.hidden_size, cfg.vocab_size
        inv_freq = inverse_frequencies(cfg.head_width, cfg.rope_theta, cfg.rope_scaling)
        self.embed: nn.Module | None = TokenEmbedding(v, h)
        self.layers = nn.ModuleDict({str(i): Block(cfg, inv_freq, i) for i in range(cfg.num_layers)})
        self.norm: nn.Module | None = RMSNorm(h, cfg.rms_norm_eps)
        self.output: nn.Module | None = (
            TiedHead(self.embed.tok) if cfg.tie_word_embeddings else nn.Linear(h, v, bias=False)
        )
        # initial values: drawn per parameter, after sharding (fleetwise.models.init)
        self.init_rule = llama_rule(cfg.init_std, cfg.num_layers)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """DecoderLM's forward; with `positions` [b, s] (packed documents, ModelSpec.optional_inputs)
        every block attends within documents only (context parallel: with the whole rows'
        `documents` ids). Not under a pipeline (validate refuses it: the positions would have to
        travel between stages with the hidden states)."""
        if positions is None:
            return super().forward(x)
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h, positions, documents)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def llama_rule(std: float, num_layers: int):
    """N(0, std) for every matrix (Hugging Face's Llama init: initializer_range), the two residual
    output projections scaled by 1/sqrt(2·layers) as GPT-2 and Megatron do (the residual stream
    does not grow with depth) -- the experts' and shared experts' down projections too; RMSNorm
    weights start at one, the routers' balancing biases at zero."""

    def rule(mname: str, module: nn.Module, attr: str, shape, g: torch.Generator) -> torch.Tensor:
        if isinstance(module, RMSNorm):
            return torch.ones(shape)
        if isinstance(module, Router) and attr == "expert_bias":
            return torch.zeros(shape)
        residual = mname.endswith(("attn.wo", "mlp.down", "mlp.shared.down"))
        residual = residual or (isinstance(module, GroupedExperts) and attr == "w2")
        scale = 1 / math.sqrt(2 * num_layers) if residual else 1.0
        return torch.randn(shape, generator=g) * (std * scale)

    return rule
