"""GPT's `model` section: the transformer fields GPT and ERNIE share, tagged `family: gpt`."""

from __future__ import annotations

from typing import Literal

from fleetwise.families.transformer import TransformerModel


class GPTModel(TransformerModel):
    """Decoder-only causal LM (GPT-2/3): pre-LN blocks, learned positions, untied LM head."""

    family: Literal["gpt"] = "gpt"
