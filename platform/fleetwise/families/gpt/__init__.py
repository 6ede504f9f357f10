"""GPT: a decoder-only causal LM (GPT-2/3): pre-LN blocks, learned positions, untied LM head."""

from __future__ import annotations

import math
from typing import Literal

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


class GPTModel(TransformerModel):
    """Decoder-only causal LM (GPT-2/3): pre-LN blocks, learned positions, untied LM head."""

    family: Literal["gpt"] = "gpt"


def units(m: GPTModel) -> list[Unit]:
    s, h, v = m.seq_len, m.hidden_size, m.padded_vocab_size
    emb = Unit(
        "embedding",
        "embedding",
        params_split=v * h,
        params_whole=s * h,
        mp_allreduces=1,
        boundary_elements=s * h,
        fwd_ops=4,  # arange, 2 lookups, add
        fwd_elementwise=2 * s * h,  # token lookups, the sum with the positions (looked up once per batch)
        param_tensors=2,
        largest_split=v * h,
        largest_whole=s * h,
    )
    head = Unit(
        "head",
        "head",
        params_split=h * v,  # LM head, column-parallel over the vocabulary (untied)
        params_whole=2 * h,  # final layer norm
        fwd_flops=2 * s * h * v,
        # final LN input; LN output (saved by the LM head); log-softmax output (vocab-parallel)
        acts={"none": Acts(fp32=s * v, sp=s * h, whole=s * h + 2 * s)},
        # the gradients of the log-softmax output and of the logits (fp32: the loss upcasts)
        transient=Acts(fp32=2 * s * v),
        transient_tp=Acts(fp32=s * v),
        output_split=s * v,  # the logits
        weight_grad_outputs=Acts(split=s * v, sp=s * h),  # the logits' and the final norm output's
        fwd_ops=10,  # LN, LM head (t, mm, views), log-softmax, NLL
        fwd_gemms=1,
        fwd_elementwise=s * h + 2 * s + s * v,  # LN, log-softmax
        param_tensors=3,  # LN weight and bias, LM head
        largest_split=h * v,
        largest_whole=h,
    )
    return [emb] + [transformer_block(m) for _ in range(m.num_layers)] + [head]


def input_bytes(m: GPTModel) -> int:
    return 2 * 8 * m.seq_len  # int64 token ids and labels


def spec(_: GPTModel) -> ModelSpec:
    from fleetwise.models.gpt import GPT, lm_loss
    from fleetwise.models.tp_plan import gpt_plan

    return ModelSpec(GPT, lm_loss, ("tokens",), gpt_plan)


def source(m: GPTModel, d):
    return token_source(m, d, m.vocab_size)[0]


FAMILY = Family(
    name="gpt",
    schema=GPTModel,
    units=units,
    input_bytes=input_bytes,
    spec=spec,
    source=source,
    check=check_shape,
    tokens_per_sample=tokens_per_sample,
    data_sources=TOKEN_SOURCES,
    data_profile=token_data_profile,
    tensor_parallel=check_tensor_parallel,
    chance_loss=lambda m: math.log(m.vocab_size),
)
