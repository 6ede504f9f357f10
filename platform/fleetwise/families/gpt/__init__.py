"""GPT: a decoder-only causal LM (GPT-2/3): pre-LN blocks, learned positions, untied LM head.

The family in one package: `schema` (the `model` section), `units` (the planner's view), `model`
(the nn.Module), `tp_plan` (its tensor-parallel plan); the data is the token source GPT and ERNIE
share (`fleetwise.families.transformer.token_source`). The rank-side parts are imported when a
rank asks for them (`spec`, `source`), so importing this package never imports torch.
"""

from __future__ import annotations

from fleetwise.families.gpt.schema import GPTModel
from fleetwise.families.gpt.units import input_bytes, units
from fleetwise.families.record import Family, ModelSpec
from fleetwise.families.transformer import (
    TOKEN_SOURCES,
    causal_lm_source,
    check_shape,
    check_tensor_parallel,
    token_chance_loss,
    token_data_profile,
    tokens_per_sample,
)


def spec(_: GPTModel) -> ModelSpec:
    from fleetwise.families.gpt.model import GPT
    from fleetwise.families.gpt.tp_plan import gpt_plan
    from fleetwise.models.transformer import lm_loss

    return ModelSpec(GPT, lm_loss, ("tokens",), gpt_plan)


FAMILY = Family(
    name="gpt",
    schema=GPTModel,
    units=units,
    input_bytes=input_bytes,
    spec=spec,
    source=causal_lm_source,
    check=check_shape,
    tokens_per_sample=tokens_per_sample,
    data_sources=TOKEN_SOURCES,
    data_profile=token_data_profile,
    tensor_parallel=check_tensor_parallel,
    chance_loss=token_chance_loss,
)
