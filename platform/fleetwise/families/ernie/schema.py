"""ERNIE's `model` section: the transformer fields GPT and ERNIE share, tagged `family: ernie`,
plus the masking settings; and its rules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from fleetwise.config.problems import Problem
from fleetwise.families.transformer import TransformerModel, check_shape


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


def masked_per_sample(m: ERNIEModel) -> int:
    """Positions the masking selects per sequence (whole words/spans up to this budget)."""
    return max(1, round(m.seq_len * m.mask_prob))
