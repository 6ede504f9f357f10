"""ERNIE: a bidirectional encoder pre-trained with knowledge masking (ERNIE 1.0/3.0): post-LN,
token types, an MLM head."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from fleetwise.config.problems import Problem
from fleetwise.families.base import Family, ModelSpec
from fleetwise.families.transformer import (
    TOKEN_SOURCES,
    TransformerModel,
    check_shape,
    check_tensor_parallel,
    token_data_profile,
    token_source,
    tokens_per_sample,
    transformer_block,
)
from fleetwise.plan.units import Acts, Unit


class ERNIEModel(TransformerModel):
    """Bidirectional encoder pre-trained with knowledge masking (ERNIE 1.0/3.0): post-LN, token types, MLM head."""

    family: Literal["ernie"] = "ernie"
    type_vocab_size: int = Field(4, ge=1, description="Sentence/segment type embeddings.")
    masking: Literal["token", "whole_word", "entity_span"] = Field(
        "whole_word",
        description="Masked-LM unit: single tokens (BERT), whole words or entity/phrase spans (ERNIE 1.0).",
    )
    mask_prob: float = Field(0.15, gt=0, lt=1, description="Fraction of tokens selected for prediction.")
    max_span_words: int = Field(3, ge=1, description="entity_span: longest span of words masked together.")


def check(m: ERNIEModel) -> Iterator[Problem]:
    yield from check_shape(m)
    if m.seq_len * m.mask_prob < 1:
        yield Problem(
            "model.mask_prob",
            f"seq_len({m.seq_len}) × mask_prob({m.mask_prob}) < 1: nothing to predict",
            "raise model.mask_prob or model.seq_len",
        )


def units(m: ERNIEModel) -> list[Unit]:
    s, h, v = m.seq_len, m.hidden_size, m.padded_vocab_size
    emb = Unit(
        "embedding",
        "embedding",
        params_split=v * h,
        params_whole=s * h + m.type_vocab_size * h + 2 * h,  # positions, token types, embedding LN
        acts={"none": Acts(sp=s * h, whole=2 * s)},  # embedding LN input
        mp_allreduces=1,
        boundary_elements=s * h,
        fwd_ops=7,  # arange, 3 lookups, 2 adds, LN
        fwd_elementwise=5 * s * h + 2 * s,  # word and type lookups, 2 adds, LN (+ mean, rstd)
        param_tensors=5,  # 3 tables, LN
        largest_split=v * h,
        largest_whole=max(s, m.type_vocab_size) * h,
    )
    head = Unit(
        "head",
        "head",
        # MLM head over every position (as BERT/ERNIE implementations do; the loss reads the masked
        # ones): dense h->h + GELU + LN (replicated), then a vocab-parallel decoder with bias.
        params_split=h * v + v,
        params_whole=h * h + h + 2 * h,
        fwd_flops=2 * s * (h * h + h * v),
        # dense input, GELU input, LN input, LN output; log-softmax output (vocab-parallel)
        acts={"none": Acts(fp32=s * v, whole=4 * s * h + 2 * s)},
        transient=Acts(fp32=2 * s * v),  # the gradients of the log-softmax output and of the logits
        transient_tp=Acts(fp32=s * v),
        output_split=s * v,  # the decoder's logits
        # the decoder's logits, the dense layer's output (replicated), the norm's output
        weight_grad_outputs=Acts(split=s * v, partial=s * h, whole=s * h),
        fwd_ops=15,  # dense, GELU, LN, decoder (t, addmm, views), log-softmax, NLL
        fwd_gemms=2,
        fwd_elementwise=2 * s * h + 2 * s + s * v,  # GELU, LN, log-softmax
        param_tensors=6,  # dense, LN, decoder
        largest_split=h * v,
        largest_whole=h * h,
    )
    return [emb] + [transformer_block(m, post_ln=True) for _ in range(m.num_layers)] + [head]


def masked_per_sample(m: ERNIEModel) -> int:
    """Positions the masking selects per sequence (whole words/spans up to this budget)."""
    return max(1, round(m.seq_len * m.mask_prob))


def input_bytes(m: ERNIEModel) -> int:
    return 3 * 8 * m.seq_len  # int64 token ids, token types and labels


def plan_notes(m: ERNIEModel) -> list[str]:
    k = masked_per_sample(m)
    return [f"masked LM: {k} of {m.seq_len} positions per sequence are predicted"]


def data_profile(m: ERNIEModel, d) -> dict:
    return {
        **token_data_profile(m, d),
        "masking": m.masking,
        "mask_prob": m.mask_prob,
        "max_span_words": m.max_span_words,
    }


def spec(_: ERNIEModel) -> ModelSpec:
    from fleetwise.models.ernie import ERNIE
    from fleetwise.models.gpt import lm_loss
    from fleetwise.models.tp_plan import ernie_plan

    return ModelSpec(ERNIE, lm_loss, ("tokens", "token_types"), ernie_plan)


def source(m: ERNIEModel, d):
    from fleetwise.data.masking import MaskedLM

    # ERNIE reserves the last id for [MASK]; synthetic text never emits it
    base, space = token_source(m, d, m.vocab_size - 1)
    return MaskedLM(
        base,
        seq_len=m.seq_len,
        vocab_size=m.vocab_size,
        masking=m.masking,
        mask_prob=m.mask_prob,
        max_span_words=m.max_span_words,
        seed=d.seed,
        space_id=space,
    )


FAMILY = Family(
    name="ernie",
    schema=ERNIEModel,
    units=units,
    input_bytes=input_bytes,
    spec=spec,
    source=source,
    check=check,
    tokens_per_sample=tokens_per_sample,
    plan_notes=plan_notes,
    data_sources=TOKEN_SOURCES,
    data_profile=data_profile,
    tensor_parallel=check_tensor_parallel,
    chance_loss=lambda m: math.log(m.vocab_size),
)
