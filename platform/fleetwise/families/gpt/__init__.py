"""GPT: a decoder-only causal LM (GPT-2/3): pre-LN blocks, learned positions, untied LM head.

A mixture of experts (`model.moe`) replaces the MLP of the blocks it names by the layer Llama uses
(fleetwise.models.moe: router, SwiGLU experts, shared experts): the same config section, rules,
planner terms and runtime.

The family in one package: `schema` (the `model` section), `units` (the planner's view), `model`
(the nn.Module), `tp_plan` (its tensor-parallel plan); the data is the token source GPT and ERNIE
share (`fleetwise.families.transformer.token_source`). The rank-side parts are imported when a
rank asks for them (`spec`, `source`), so importing this package never imports torch.
"""

from __future__ import annotations

from fleetwise.families.gpt.schema import GPTModel, check, limits
from fleetwise.families.gpt.units import input_bytes, units
from fleetwise.families.moe import moe_notes, tp_plan_of
from fleetwise.families.record import Family, ModelSpec
from fleetwise.families.transformer import (
    TOKEN_SOURCES,
    causal_lm_source,
    check_tensor_parallel,
    token_chance_loss,
    token_data_profile,
    tokens_per_sample,
)


def spec(m: GPTModel) -> ModelSpec:
    from fleetwise.families.gpt.model import GPT
    from fleetwise.families.gpt.tp_plan import gpt_plan
    from fleetwise.models.transformer import lm_loss

    # a MoE block's experts are not split over mp ranks (families/moe.py tp_plan_of)
    return ModelSpec(GPT, lm_loss, ("tokens",), tp_plan_of(gpt_plan, m.moe, m.num_layers))


def plan_notes(m: GPTModel) -> list[str]:
    return moe_notes(m.moe, m.num_layers, m.ffn_hidden_size)


FAMILY = Family(
    name="gpt",
    schema=GPTModel,
    units=units,
    input_bytes=input_bytes,
    spec=spec,
    source=causal_lm_source,
    check=check,
    limits=limits,
    plan_notes=plan_notes,
    tokens_per_sample=tokens_per_sample,
    data_sources=TOKEN_SOURCES,
    data_profile=token_data_profile,
    tensor_parallel=check_tensor_parallel,
    chance_loss=token_chance_loss,
)
