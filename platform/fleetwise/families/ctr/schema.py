"""The CTR family's `model` section (DeepFM or Wide&Deep over sparse tables) and its rules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import Field

from fleetwise.config.base import Section
from fleetwise.config.problems import Problem

MAX_TABLE_ROWS = 10**13
MAX_TABLES = 1024
MAX_MLP_LAYERS = 256


class SparseTable(Section):
    name: str = Field(description="Feature field name (also the parameter name on the servers).")
    num_embeddings: int = Field(ge=1, description="Rows (distinct ids of the field).")
    distributed: bool = Field(
        True,
        description="Rows live only on parameter servers (is_distributed); trainers pull the rows of a batch.",
    )


class CTRModel(Section):
    """Click-through-rate model over sparse id fields and dense features: DeepFM or Wide&Deep."""

    family: Literal["ctr"] = "ctr"
    kind: Literal["deepfm", "wide_deep"] = Field(
        "deepfm", description="DeepFM (Guo et al. 2017) or Wide&Deep."
    )
    embedding_dim: int = Field(ge=1, description="Embedding width of every sparse field.")
    sparse_tables: list[SparseTable] = Field(
        min_length=1, description="One embedding table per sparse field."
    )
    num_dense_features: int = Field(13, ge=0, description="Continuous features (Criteo has 13).")
    mlp_hidden: list[Annotated[int, Field(ge=1)]] = Field(description="Widths of the deep MLP.")

    @property
    def num_layers(self) -> int:
        return len(self.mlp_hidden)


def check(m: CTRModel) -> Iterator[Problem]:
    names = [t.name for t in m.sparse_tables]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        yield Problem(
            "model.sparse_tables",
            f"duplicate table names {dupes}",
            "give every sparse table a unique name",
        )


def limits(m: CTRModel) -> Iterator[Problem]:
    if len(m.sparse_tables) > MAX_TABLES:
        yield Problem(
            "model.sparse_tables",
            f"{len(m.sparse_tables):,} sparse tables, at most {MAX_TABLES:,}",
            "merge feature fields into fewer tables",
        )
    for i, t in enumerate(m.sparse_tables):
        if t.num_embeddings > MAX_TABLE_ROWS:
            yield Problem(
                f"model.sparse_tables.{i}.num_embeddings",
                f"table {t.name!r} has {t.num_embeddings:,} rows, at most {MAX_TABLE_ROWS:,}",
                "hash the ids into fewer rows",
            )
    if len(m.mlp_hidden) > MAX_MLP_LAYERS or any(w > 1 << 20 for w in m.mlp_hidden):
        yield Problem(
            "model.mlp_hidden",
            f"at most {MAX_MLP_LAYERS} MLP layers of width up to {1 << 20:,}",
            "use a smaller MLP",
        )
