"""ERNIE: a bidirectional encoder pre-trained with knowledge masking (ERNIE 1.0/3.0): post-LN,
token types, an MLM head.

The family in one package: `schema` (the `model` section and its rules), `units` (the planner's
view), `model` (the nn.Module), `tp_plan` (its tensor-parallel plan), `data` (knowledge masking
over the token source GPT and ERNIE share). The rank-side parts are imported when a rank asks for
them (`spec`, `source`), so importing this package never imports torch.
"""

from __future__ import annotations

from fleetwise.families.ernie.schema import ERNIEModel, check
from fleetwise.families.ernie.units import input_bytes, plan_notes, units
from fleetwise.families.record import Family, ModelSpec
from fleetwise.families.transformer import (
    TOKEN_SOURCES,
    check_tensor_parallel,
    token_chance_loss,
    token_data_profile,
    token_source,
    tokens_per_sample,
)


def data_profile(m: ERNIEModel, d) -> dict:
    return {
        **token_data_profile(m, d),
        "masking": m.masking,
        "mask_prob": m.mask_prob,
        "max_span_words": m.max_span_words,
    }


def spec(_: ERNIEModel) -> ModelSpec:
    from fleetwise.families.ernie.model import ERNIE
    from fleetwise.families.ernie.tp_plan import ernie_plan
    from fleetwise.models.transformer import lm_loss

    return ModelSpec(ERNIE, lm_loss, ("tokens", "token_types"), ernie_plan)


def source(m: ERNIEModel, d):
    from fleetwise.families.ernie.data import MaskedLM

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
    chance_loss=token_chance_loss,
)
