"""GPT's `model` section: the transformer fields GPT and ERNIE share, tagged `family: gpt`, and an
optional mixture of experts in place of the blocks' MLPs (`moe`, fleetwise.families.moe, as Llama's)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from fleetwise.config.problems import Problem, over_limits
from fleetwise.families.moe import MOE_LIMITS, MoE, check_moe
from fleetwise.families.transformer import TransformerModel, check_shape


class GPTModel(TransformerModel):
    """Decoder-only causal LM (GPT-2/3): pre-LN blocks, learned positions, untied LM head."""

    family: Literal["gpt"] = "gpt"
    moe: MoE = Field(
        default_factory=MoE,
        description="Mixture of experts in place of the dense MLPs (num_experts 0: none; the experts are "
        "SwiGLU, as Llama's: fleetwise.families.moe).",
    )


def check(m: GPTModel) -> Iterator[Problem]:
    yield from check_shape(m)
    yield from check_moe(m.moe, m.num_layers)


def limits(m: GPTModel) -> Iterator[Problem]:
    """Bounds on the fields the shared bounds (config/rules/limits.py) do not know: the experts'."""
    yield from over_limits(m.moe, MOE_LIMITS)
