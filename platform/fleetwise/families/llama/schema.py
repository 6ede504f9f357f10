"""Llama's `model` section (Llama 3 and the models of its shape: Qwen 3 with `qk_norm`) and its rules.

The field names are Meta's and Hugging Face's (`LlamaConfig`: intermediate_size, rope_theta,
rms_norm_eps, tie_word_embeddings, num_key_value_heads -> num_kv_heads), so that a config.json maps
onto this section by a name table; the widths GPT and ERNIE share keep fleetwise's names
(num_layers, hidden_size, num_attention_heads, vocab_size, seq_len).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from fleetwise.config.base import Section
from fleetwise.config.problems import Problem, over_limits
from fleetwise.families.moe import MOE_LIMITS, MoE, check_moe
from fleetwise.families.transformer import mp_divides


class RopeScaling(Section):
    """Llama 3.1's "llama3" frequency scaling (Hugging Face `rope_scaling` / `rope_parameters`):
    wavelengths above original_max_position_embeddings / low_freq_factor are divided by `factor`,
    those below original_max_position_embeddings / high_freq_factor are kept, the band between is
    interpolated."""

    rope_type: Literal["llama3"] = Field("llama3", description="The scaling scheme (Llama 3.1's).")
    factor: float = Field(8.0, gt=0, description="Divides the low frequencies (Llama 3.1: 8, 3.2: 32).")
    low_freq_factor: float = Field(1.0, gt=0, description="Wavelengths above L/low_freq_factor are scaled.")
    high_freq_factor: float = Field(4.0, gt=0, description="Wavelengths below L/high_freq_factor are kept.")
    original_max_position_embeddings: int = Field(
        8192, ge=1, description="L: the context length the model was pre-trained with."
    )


class LlamaModel(Section):
    """Decoder-only causal LM of Llama 3's shape: RMSNorm, rotary positions, SwiGLU, grouped-query
    attention, no biases; optionally tied embeddings and Qwen-3's per-head q/k RMSNorm."""

    family: Literal["llama"] = "llama"
    num_layers: int = Field(ge=1, description="Transformer blocks.")
    hidden_size: int = Field(ge=1, description="Model width h.")
    num_attention_heads: int = Field(ge=1, description="Query heads a.")
    num_kv_heads: int = Field(
        ge=1, description="Key/value heads (grouped-query attention: a / num_kv_heads queries share one)."
    )
    head_dim: int | None = Field(
        None, ge=1, description="Width of one head (null: hidden_size / num_attention_heads)."
    )
    vocab_size: int = Field(ge=2, description="Token vocabulary (not padded: mp_degree must divide it).")
    seq_len: int = Field(ge=2, description="Tokens per sample.")
    intermediate_size: int | None = Field(
        None,
        ge=1,
        description="Width of the SwiGLU MLP (null: from ffn_dim_multiplier and multiple_of, as Meta's Llama).",
    )
    ffn_dim_multiplier: float | None = Field(
        None, gt=0, description="Scales the MLP width int(8h/3) (Llama 3 8B/70B: 1.3, 405B: 1.2, 1B: 1.5)."
    )
    multiple_of: int = Field(256, ge=1, description="The MLP width is rounded up to a multiple of this.")
    rope_theta: float = Field(10000.0, gt=0, description="Rotary base θ (Llama 3: 500000).")
    rope_scaling: RopeScaling | None = Field(None, description="Llama 3.1's frequency scaling, or null.")
    rms_norm_eps: float = Field(1e-5, gt=0, description="RMSNorm's epsilon.")
    tie_word_embeddings: bool = Field(
        False, description="The LM head reuses the token embedding (Llama 3.2 1B/3B); not with pp_degree > 1."
    )
    qk_norm: bool = Field(False, description="RMSNorm over each query and key head before RoPE (Qwen 3).")
    init_std: float = Field(
        0.02, gt=0, description="Std of the normal weight init (Llama's initializer_range)."
    )
    moe: MoE = Field(
        default_factory=MoE,
        description="Mixture of experts in place of the dense MLPs (num_experts 0: none; fleetwise.families.moe).",
    )
    init_from: str | None = Field(
        None,
        description="A Hugging Face model directory (config.json + *.safetensors) to start from: its "
        "config.json fills this section, each rank reads its slices of the weights (null: random init).",
    )

    @property
    def head_width(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def ffn_hidden_size(self) -> int:
        """The SwiGLU width: intermediate_size, or Meta's rule (llama/model.py, FeedForward):
        int(2·4h/3), times ffn_dim_multiplier (truncated), rounded up to multiple_of."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        width = int(2 * 4 * self.hidden_size / 3)
        if self.ffn_dim_multiplier is not None:
            width = int(self.ffn_dim_multiplier * width)
        return -(-width // self.multiple_of) * self.multiple_of

    @property
    def padded_vocab_size(self) -> int:
        # not padded: a Hugging Face checkpoint's embedding has exactly vocab_size rows, and padded
        # rows would change the softmax of its logits
        return self.vocab_size


def check(m: LlamaModel) -> Iterator[Problem]:
    yield from check_moe(m.moe, m.num_layers)
    if m.init_from is not None:
        from fleetwise.families.llama.hf import check_weights

        yield from check_weights(m)
    if m.num_attention_heads % m.num_kv_heads:
        yield Problem(
            "model.num_kv_heads",
            f"num_attention_heads={m.num_attention_heads} does not divide by num_kv_heads={m.num_kv_heads}",
            "choose num_kv_heads dividing num_attention_heads (each kv head serves a whole group of "
            "query heads; num_kv_heads = num_attention_heads is plain multi-head attention)",
        )
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        yield Problem(
            "model.hidden_size",
            f"hidden_size={m.hidden_size} does not divide by num_attention_heads={m.num_attention_heads}",
            "choose heads dividing the width, or set model.head_dim explicitly",
        )
    if m.head_width % 2:
        yield Problem(
            "model.head_dim",
            f"the head width is {m.head_width}, odd: rotary embeddings rotate pairs of dimensions",
            "use an even head width (hidden_size / num_attention_heads, or model.head_dim)",
        )
    s = m.rope_scaling
    if s is not None and s.high_freq_factor <= s.low_freq_factor:
        yield Problem(
            "model.rope_scaling.high_freq_factor",
            f"high_freq_factor={s.high_freq_factor} is not above low_freq_factor={s.low_freq_factor}: "
            "the band interpolated between them is empty",
            "use Llama 3.1's values: low_freq_factor=1, high_freq_factor=4",
        )


def check_tensor_parallel(m: LlamaModel, mp: int) -> Iterator[Problem]:
    """mp ranks split the vocabulary (not padded), the query and the kv heads, and the MLP."""
    if m.vocab_size % mp:
        padded = -(-m.vocab_size // mp) * mp
        yield Problem(
            "strategy.mp_degree",
            f"mp_degree={mp} does not divide model.vocab_size={m.vocab_size} (Llama's vocabulary is not "
            "padded: a checkpoint's embedding has exactly vocab_size rows)",
            f"use an mp_degree dividing {m.vocab_size}, or set model.vocab_size={padded} (ids the data "
            "never holds are never predicted)",
        )
    for key in ("num_attention_heads", "num_kv_heads"):
        yield from mp_divides(mp, key, getattr(m, key))
    if m.intermediate_size is not None:
        yield from mp_divides(mp, "intermediate_size", m.intermediate_size)
    elif m.ffn_hidden_size % mp:
        yield Problem(
            "strategy.mp_degree",
            f"mp_degree={mp} does not divide the MLP width {m.ffn_hidden_size} (from hidden_size, "
            f"ffn_dim_multiplier and multiple_of={m.multiple_of})",
            "use an mp_degree dividing it, or set model.multiple_of to a multiple of mp_degree",
        )


def no_pipeline(m: LlamaModel) -> tuple[str, str] | None:
    """(why, fix) when this model cannot be pipelined: a tied head would be one weight on two stages."""
    if not m.tie_word_embeddings:
        return None
    return (
        "a model with model.tie_word_embeddings=true: the embedding (first stage) and the LM head "
        "(last stage) would be one weight on two ranks",
        "set strategy.pp_degree=1 (and shard with strategy.sharding_degree or split with "
        "strategy.mp_degree instead), or set model.tie_word_embeddings=false (the head gets a "
        "weight of its own)",
    )


LIMITS = {
    "model.num_kv_heads": 1 << 16,
    "model.head_dim": 1 << 16,
    "model.intermediate_size": 1 << 22,
    "model.multiple_of": 1 << 22,
}


def limits(m: LlamaModel) -> Iterator[Problem]:
    """Bounds on the fields the shared bounds (config/rules/limits.py) do not know."""
    yield from over_limits(m, LIMITS)
    yield from over_limits(m.moe, MOE_LIMITS)
    if m.ffn_hidden_size > 1 << 22:
        yield Problem(
            "model.ffn_dim_multiplier",
            f"the MLP width {m.ffn_hidden_size:,} is beyond what fleetwise plans (at most {1 << 22:,})",
            "lower model.ffn_dim_multiplier or model.multiple_of",
        )
