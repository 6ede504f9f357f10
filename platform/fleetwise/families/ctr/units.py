"""Click-through-rate model over sparse id fields and dense features: DeepFM or Wide&Deep.
The family the parameter server trains: its embedding tables can live on servers."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import Field

from fleetwise.config.base import Section
from fleetwise.config.problems import Problem
from fleetwise.families.base import Family, ModelSpec
from fleetwise.plan.units import Acts, Unit

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


def mlp_dims(m: CTRModel) -> list[int]:
    return [len(m.sparse_tables) * m.embedding_dim + m.num_dense_features, *m.mlp_hidden, 1]


def parameter_shapes(m: CTRModel) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of `fleetwise.models.ctr.CTRNet` by name and shape, in `named_parameters()`
    order. The parameter server places variables by these names; a test checks them against torch."""
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for t in m.sparse_tables:
        shapes.append((f"embeddings.{t.name}.weight", (t.num_embeddings, m.embedding_dim)))
    for t in m.sparse_tables:
        shapes.append((f"first_order.{t.name}.weight", (t.num_embeddings, 1)))
    shapes.append(("dense_first_order.weight", (1, m.num_dense_features)))
    shapes.append(("dense_first_order.bias", (1,)))
    dims = mlp_dims(m)
    for i, (a, b) in enumerate(zip(dims, dims[1:], strict=False)):
        # nn.Sequential(Linear, ReLU, Linear, ReLU, ..., Linear): linears sit at even indices
        shapes.append((f"mlp.{2 * i}.weight", (b, a)))
        shapes.append((f"mlp.{2 * i}.bias", (b,)))
    return shapes


def units(m: CTRModel) -> list[Unit]:
    fields = len(m.sparse_tables)
    rows = sum(t.num_embeddings for t in m.sparse_tables)
    dims = mlp_dims(m)
    mlp = sum(a * b + b for a, b in zip(dims, dims[1:], strict=False))
    mlp_flops = 2 * sum(a * b for a, b in zip(dims, dims[1:], strict=False))
    linears = len(dims) - 1
    return [
        Unit(
            "embedding",
            "embedding",
            # per table: k-dim embedding + 1-dim first-order weight; dense first-order linear (+bias)
            params_whole=rows * (m.embedding_dim + 1) + m.num_dense_features + 1,
            acts={"none": Acts(whole=fields * (m.embedding_dim + 1))},
            fwd_ops=4 * fields + 2,  # per table: select + lookup, twice (embedding, first order); stack, cat
            fwd_elementwise=2 * fields * (m.embedding_dim + 1),  # the lookups, then stacked
            param_tensors=2 * fields + 2,  # embedding and first-order table per field, dense linear
            largest_whole=max(
                [t.num_embeddings * m.embedding_dim for t in m.sparse_tables] + [m.num_dense_features]
            ),
        ),
        Unit(
            "mlp",
            "block",
            params_whole=mlp,
            fwd_flops=mlp_flops + 4 * fields * m.embedding_dim,
            acts={"none": Acts(whole=2 * sum(dims[1:]) + dims[0])},
            # dense first order 5, FM 8 (DeepFM), concat 2, linears 2 each, ReLU 2 each, output 2, loss 1
            fwd_ops=5 + (8 if m.kind == "deepfm" else 0) + 2 + 2 * linears + 2 * (linears - 1) + 3,
            fwd_gemms=linears + 1,  # the MLP and the dense first-order linear
            param_tensors=2 * linears,
            largest_whole=max(a * b for a, b in zip(dims, dims[1:], strict=False)),
            # concatenated input, ReLU outputs, FM squares and sums (DeepFM)
            fwd_elementwise=dims[0]
            + sum(dims[1:-1])
            + (4 * fields * m.embedding_dim if m.kind == "deepfm" else 0),
        ),
    ]


def input_bytes(m: CTRModel) -> int:
    return 8 * len(m.sparse_tables) + 4 * m.num_dense_features + 4  # int64 ids, fp32 dense and label


def data_profile(m: CTRModel, d) -> dict:
    return {"zipf_alpha": d.zipf_alpha, "model": m.model_dump(mode="json")}


def spec(_: CTRModel) -> ModelSpec:
    from fleetwise.models.ctr import CTRNet, ctr_loss

    return ModelSpec(CTRNet, ctr_loss, ("sparse_ids", "dense"))


def source(m: CTRModel, d):
    from fleetwise.data.ctr import SyntheticClicks

    return SyntheticClicks(m, d)


FAMILY = Family(
    name="ctr",
    schema=CTRModel,
    units=units,
    input_bytes=input_bytes,
    spec=spec,
    source=source,
    check=check,
    limits=limits,
    data_profile=data_profile,
    no_tensor_parallel=(
        "its embedding tables belong on parameter servers",
        "set strategy.mp_degree=1 and use dp or sharding, or strategy=ps",
    ),
    no_pipeline=(
        "a CTR model: its MLP is too shallow to pipeline",
        "set strategy.pp_degree=1; use strategy=ps for large embedding tables",
    ),
    no_recompute=("a CTR model has no repeated blocks to recompute", "set strategy.recompute=none"),
    sparse_tables=lambda m: m.sparse_tables,
    sparse_row_width=lambda m: m.embedding_dim + 1,  # embedding + first-order weight
    parameter_shapes=parameter_shapes,
    chance_loss=lambda m: math.log(2),
)
