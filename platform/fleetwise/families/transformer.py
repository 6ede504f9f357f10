"""What GPT and ERNIE share: the transformer schema fields, the block's planner unit, the shape
and tensor-parallel checks, and the token source (synthetic or a token file). Llama shares the
token source, GPT's causal-LM source, the chance loss and the tensor-parallel divisibility check
(`mp_divides`).

Transformer families share one naming scheme: num_layers, hidden_size, num_attention_heads,
ffn_hidden_size, vocab_size, seq_len.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from pydantic import Field

from fleetwise.config.base import Section
from fleetwise.config.problems import Problem
from fleetwise.plan.units import Acts, Unit

# Embedding and LM-head rows are padded to a multiple of this, independent of the layout, so a model
# has the same parameters under every mp_degree (checkpoints reshard; parity tests compare exactly).
VOCAB_MULTIPLE = 64

TOKEN_SOURCES = ("bundled", "token_file")


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


class TransformerModel(Section):
    num_layers: int = Field(ge=1, description="Transformer blocks.")
    hidden_size: int = Field(ge=1, description="Model width h.")
    num_attention_heads: int = Field(ge=1, description="Attention heads a (h must divide by a).")
    ffn_hidden_size: int = Field(ge=1, description="Width of the MLP inside each block (usually 4h).")
    vocab_size: int = Field(
        ge=2, description="Token vocabulary (embedding rows are padded to a multiple of 64)."
    )
    seq_len: int = Field(ge=2, description="Tokens per sample (also the number of learned positions).")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout probability (0 keeps runs bit-reproducible)."
    )
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init (GPT-2/BERT use 0.02).")

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab(self.vocab_size)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def token_data_profile(m: TransformerModel, _d) -> dict:
    return {"vocab_size": m.vocab_size, "seq_len": m.seq_len}


def tokens_per_sample(m: TransformerModel) -> int:
    return m.seq_len


def token_chance_loss(m: TransformerModel) -> float:
    """The loss of uniform guesses over the vocabulary (what a language model's loss is shown against)."""
    return math.log(m.vocab_size)


def causal_lm_source(m: TransformerModel, d):
    """Rank side: the sample source of a causal LM (GPT, Llama): tokens over the whole vocabulary."""
    return token_source(m, d, m.vocab_size)[0]


def check_shape(m: TransformerModel) -> Iterator[Problem]:
    if m.hidden_size % m.num_attention_heads:
        yield Problem(
            "model.hidden_size",
            f"hidden_size={m.hidden_size} does not divide by num_attention_heads={m.num_attention_heads}",
            "choose heads dividing the width (head_dim = hidden_size / num_attention_heads)",
        )


def check_tensor_parallel(m: TransformerModel, mp: int) -> Iterator[Problem]:
    """mp ranks split the padded vocabulary, the heads, the width and the MLP."""
    padded = padded_vocab(m.vocab_size)
    if padded % mp:
        yield Problem(
            "strategy.mp_degree",
            f"mp_degree={mp} does not divide the padded vocabulary "
            f"({m.vocab_size} -> {padded}, a multiple of {VOCAB_MULTIPLE})",
            f"use an mp_degree dividing {padded}",
        )
    for key in ("num_attention_heads", "hidden_size", "ffn_hidden_size"):
        yield from mp_divides(mp, key, getattr(m, key))


def mp_divides(mp: int, key: str, value: int) -> Iterator[Problem]:
    """mp_degree must divide model.<key> (a width tensor parallelism splits)."""
    if value % mp:
        divisors = [d for d in range(1, min(value, 64) + 1) if value % d == 0]  # not up to value: 10^11 hangs
        yield Problem(
            "strategy.mp_degree",
            f"mp_degree={mp} does not divide model.{key}={value}",
            f"use an mp_degree that divides {value} (e.g. {', '.join(map(str, divisors[-4:]))})",
        )


def token_source(m: TransformerModel, d, vocab_size: int):
    """Rank side: token ids from a token file, or synthetic text over `vocab_size` ids; with the
    space id of the file's tokenizer (None for synthetic text), which word-level masking needs."""
    from fleetwise.data.tokens import SyntheticTokens, TokenFile

    if d.source == "bundled":
        from fleetwise.data.bundled import BundledText

        base = BundledText(m.seq_len)
        return base, base.space_id
    if d.source == "token_file":
        base = TokenFile(d.path, m.seq_len)
        return base, base.space_id
    if d.source == "jsonl":  # Llama's fine-tuning documents, packed (families/llama: data_sources)
        from fleetwise.data.jsonl import PackedJsonl

        return PackedJsonl.of(d, m.init_from, m.seq_len), None
    return SyntheticTokens(vocab_size, m.seq_len, d.seed, d.num_samples), None


def transformer_block(m: TransformerModel, *, post_ln: bool = False) -> Unit:
    s, h, f, a = m.seq_len, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads
    # q, k, v and fc1 are column-parallel (weight and bias split); out-proj and fc2 are row-parallel
    # (weight split, bias replicated); both layer norms are replicated.
    split = 4 * h * h + 2 * h * f + 3 * h + f
    whole = 2 * h + 4 * h
    none = Acts(
        # q, k, v; SDPA output and log-sum-exp (the out-projection's input is a view of that
        # output: SDPA lays it out sequence-major, so its transpose back needs no copy); fc1 output
        # (GELU input) and GELU output (fc2 input).
        split=3 * s * h + s * h + a * s + 2 * s * f,
        # the inputs of the two layer norms (sequence parallel shards them)
        sp=2 * s * h,
        # the outputs of the two layer norms, saved by the column-parallel linears that read them
        # (gathered in full under sequence parallelism); LN mean/rstd
        whole=2 * s * h + 4 * s,
    )
    selective = Acts(
        # selective checkpointing keeps matmul and attention outputs and recomputes norms and GELU
        split=3 * s * h + s * h + a * s + s * f,
        sp=s * h,  # block input
        # out-proj and fc2 outputs, reduced (reduce-scatter / all-reduce) when tensor-parallel
        reduced=2 * s * h,
    )
    full = Acts(sp=s * h)  # only the block input; the block is recomputed during backward
    attn = 2 * 2 * s * s * h  # QK^T and scores·V, counted as full (non-causal) matmuls
    return Unit(
        name="block",
        kind="block",
        params_split=split,
        params_whole=whole,
        fwd_flops=2 * s * (4 * h * h + 2 * h * f) + attn,
        attn_flops=attn,
        # pre-LN: fc2 feeds only the residual add; post-LN: its sum feeds ln2, which saves it
        recompute_skipped_flops=0 if post_ln else 2 * s * f * h,
        # under TP, selective recompute re-runs the out-projection (the second norm needs the
        # residual after it) and, post-LN, fc2 (the second norm reads its sum)
        selective_tp_recompute_flops=2 * s * h * h + (2 * s * f * h if post_ln else 0),
        acts={"none": none, "selective": selective, "full": full},
        backward_transient=Acts(split=s * f),  # fc2's input gradient (the GELU output's)
        # the q, k, v and fc1 outputs (column-parallel), the out-projection's and fc2's partial sums,
        # the two norms' outputs
        weight_grad_outputs=Acts(split=3 * s * h + s * f, partial=2 * s * h, sp=2 * s * h),
        mp_allreduces=2,
        boundary_elements=s * h,
        fwd_ops=39,  # pre- and post-LN alike: 2 LN, 6 linears (t, addmm, views), SDPA, GELU, 2 adds
        fwd_gemms=7,  # 6 linears, SDPA
        param_tensors=16,  # 6 linears and 2 layer norms, weight and bias each
        largest_split=max(h * f, h * h),
        largest_whole=h,
        fwd_elementwise=2 * (s * h + 2 * s) + 2 * s * h + s * f,  # 2 LN (+ mean, rstd), 2 adds, GELU
    )
