"""Rules of the `model` section: shapes each family needs, CTR tables."""

from __future__ import annotations

from collections.abc import Iterator

from fleetwise.config.model import (
    CTRModel,
    ERNIEModel,
    ResNetModel,
    TransformerModel,
)
from fleetwise.config.problems import Problem
from fleetwise.config.rules import Context, rule


@rule
def ctr_tables_unique(ctx: Context) -> Iterator[Problem]:
    m = ctx.cfg.model
    if isinstance(m, CTRModel):
        names = [t.name for t in m.sparse_tables]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            yield Problem(
                "model.sparse_tables",
                f"duplicate table names {dupes}",
                "give every sparse table a unique name",
            )


@rule
def transformer_shape(ctx: Context) -> Iterator[Problem]:
    m = ctx.cfg.model
    if not isinstance(m, TransformerModel):
        return
    if m.hidden_size % m.num_attention_heads:
        yield Problem(
            "model.hidden_size",
            f"hidden_size={m.hidden_size} does not divide by num_attention_heads={m.num_attention_heads}",
            "choose heads dividing the width (head_dim = hidden_size / num_attention_heads)",
        )
    if isinstance(m, ERNIEModel) and m.seq_len * m.mask_prob < 1:
        yield Problem(
            "model.mask_prob",
            f"seq_len({m.seq_len}) × mask_prob({m.mask_prob}) < 1: nothing to predict",
            "raise model.mask_prob or model.seq_len",
        )


@rule
def resnet_shape(ctx: Context) -> Iterator[Problem]:
    m = ctx.cfg.model
    if isinstance(m, ResNetModel):
        if m.image_size < 32:
            yield Problem(
                "model.image_size",
                f"image_size={m.image_size}: ResNet downsamples by 32",
                "use model.image_size >= 32",
            )
        if len(m.layers) != 4:
            yield Problem(
                "model.layers",
                f"{len(m.layers)} stages given; ResNet has 4 (e.g. [3, 4, 6, 3])",
                "give four block counts",
            )
