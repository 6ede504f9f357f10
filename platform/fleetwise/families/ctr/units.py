"""The CTR model as planner units (the embedding tables, the MLP with the first-order and FM terms)
and every parameter by name and shape (what the parameter server places)."""

from __future__ import annotations

from fleetwise.families.ctr.schema import CTRModel
from fleetwise.plan.units import Acts, Unit


def mlp_dims(m: CTRModel) -> list[int]:
    return [len(m.sparse_tables) * m.embedding_dim + m.num_dense_features, *m.mlp_hidden, 1]


def parameter_shapes(m: CTRModel) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of `fleetwise.families.ctr.model.CTRNet` by name and shape, in `named_parameters()`
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
