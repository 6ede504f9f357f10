"""CTR models over sparse id fields and dense features: DeepFM (Guo et al. 2017) and Wide&Deep.

    logit = first-order(ids, dense) [+ FM second-order(embeddings)] + MLP([embeddings, dense])

DeepFM adds the factorization-machine term 0.5·Σ_k((Σ_f e_fk)² − Σ_f e_fk²); Wide&Deep has the same
parameters (the "wide" part is the first-order term) without it, so both plan identically.

Each field f has a table of `num_embeddings` rows: an embedding (embedding_dim) and a first-order
weight (1), the accounting of `fleetwise.families.ctr.units.parameter_shapes`. The tables are separable
from the dense part: `forward(sparse_ids, dense)` looks them up (ordinary, collective training);
`forward_rows(emb, first_order, dense)` takes looked-up rows, which is how parameter-server trainers
run the model without ever holding the distributed tables (`remote_tables=True` leaves them out).

Initialisation is deterministic from `seed` and independent of the global RNG. A table is drawn in
fixed chunks of rows, each from its own generator, so a server can build just its shard of a huge
table (`table_init`) and get exactly the rows the full model would have.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from fleetwise.families.ctr.schema import CTRModel
from fleetwise.models.init import mix_seed

EMBEDDING_STD = 0.05
TABLE_CHUNK_ROWS = 1 << 16


def table_init(
    seed: int, field: int, num_rows: int, width: int, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Initial values of field `field`'s table [num_rows, width] (embedding columns, then the
    first-order weight), or only of `rows` (int64 ids): N(0, EMBEDDING_STD²), chunk by chunk."""
    if rows is None:
        rows = torch.arange(num_rows)
    out = torch.empty(len(rows), width)
    chunk_of = rows // TABLE_CHUNK_ROWS
    for c in torch.unique(chunk_of).tolist():
        start = c * TABLE_CHUNK_ROWS
        size = min(TABLE_CHUNK_ROWS, num_rows - start)
        g = torch.Generator().manual_seed(mix_seed(seed, field, c))
        block = torch.randn(size, width, generator=g) * EMBEDDING_STD
        sel = chunk_of == c
        out[sel] = block[rows[sel] - start]
    return out


def _empty(cls, *args) -> nn.Module:
    """A module with uninitialised parameters, on the current default device (`meta` when the
    runtime builds the model's structure only)."""
    return skip_init(cls, *args, device=torch.get_default_device())


class CTRNet(nn.Module):
    # The model contract (fleetwise.models.contract): CTR models are neither pipelined nor recomputed
    # (validation refuses both), so there are no repeated blocks; FSDP shards the root module.
    first_modules: tuple[str, ...] = ()
    last_modules: tuple[str, ...] = ()

    def __init__(self, cfg: CTRModel, *, seed: int | None = None, remote_tables: bool = False) -> None:
        """seed: of the initialisation; None takes torch's current seed (`torch.manual_seed`)."""
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleDict()
        self.fields = [t.name for t in cfg.sparse_tables]
        # remote_tables: distributed tables live on parameter servers; only the rest is built here
        local = [t for t in cfg.sparse_tables if not (remote_tables and t.distributed)]
        k, d = cfg.embedding_dim, cfg.num_dense_features
        # skip_init: torch's default initialisation would be overwritten by reset_parameters anyway
        self.embeddings = nn.ModuleDict({t.name: _empty(nn.Embedding, t.num_embeddings, k) for t in local})
        self.first_order = nn.ModuleDict({t.name: _empty(nn.Embedding, t.num_embeddings, 1) for t in local})
        with warnings.catch_warnings():  # d = 0 (no dense features) is a valid, empty weight
            warnings.filterwarnings("ignore", "Initializing zero-element tensors")
            self.dense_first_order = _empty(nn.Linear, d, 1)
        dims = [len(self.fields) * k + d, *cfg.mlp_hidden, 1]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims, dims[1:], strict=False)):
            layers.append(_empty(nn.Linear, a, b))
            if i < len(dims) - 2:
                layers.append(nn.ReLU())
        self.mlp = nn.Sequential(*layers)
        if self.mlp[0].weight.is_meta:  # built on `meta`: values come later, by initial_value
            return
        self.reset_parameters(torch.initial_seed() if seed is None else seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        for i, t in enumerate(self.cfg.sparse_tables):
            if t.name in self.embeddings:
                rows = table_init(seed, i, t.num_embeddings, self.cfg.embedding_dim + 1)
                self.embeddings[t.name].weight.copy_(rows[:, :-1])
                self.first_order[t.name].weight.copy_(rows[:, -1:])
        # Linear layers: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias (torch's default
        # bound), drawn from one generator in module order.
        g = torch.Generator().manual_seed(mix_seed(seed, -1))
        for lin in [self.dense_first_order, *(m for m in self.mlp if isinstance(m, nn.Linear))]:
            bound = 1.0 / math.sqrt(max(lin.in_features, 1))
            for p in (lin.weight, lin.bias):
                p.copy_(torch.rand(p.shape, generator=g) * 2 * bound - bound)

    @torch.no_grad()
    def initial_value(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The value `reset_parameters(seed)` gives parameter `name`, computed alone (for a model
        built on `meta` and sharded before it is materialised: fleetwise.models.init)."""
        kind, _, rest = name.partition(".")
        if kind in ("embeddings", "first_order"):
            field = self.fields.index(rest.split(".")[0])
            rows = table_init(seed, field, shape[0], self.cfg.embedding_dim + 1)
            return rows[:, :-1] if kind == "embeddings" else rows[:, -1:]
        # the dense linears share one generator drawn in module order: replay it up to `name`
        g = torch.Generator().manual_seed(mix_seed(seed, -1))
        names = ["dense_first_order"] + [
            f"mlp.{i}" for i, m in enumerate(self.mlp) if isinstance(m, nn.Linear)
        ]
        for lin_name in names:
            lin = self.get_submodule(lin_name)
            bound = 1.0 / math.sqrt(max(lin.in_features, 1))
            for attr in ("weight", "bias"):
                value = torch.rand(getattr(lin, attr).shape, generator=g) * 2 * bound - bound
                if f"{lin_name}.{attr}" == name:
                    return value
        raise KeyError(name)

    def lookup(self, sparse_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the local tables: embeddings [B, F, k] and first-order weights [B, F]."""
        emb = torch.stack([self.embeddings[n](sparse_ids[:, f]) for f, n in enumerate(self.fields)], 1)
        first = torch.cat([self.first_order[n](sparse_ids[:, f]) for f, n in enumerate(self.fields)], 1)
        return emb, first

    def forward(self, sparse_ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """sparse_ids int64 [B, F], dense float [B, d] -> logits [B]."""
        emb, first = self.lookup(sparse_ids)
        return self.forward_rows(emb, first, dense)

    def forward_rows(self, emb: torch.Tensor, first_order: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """The model after the table lookup: emb [B, F, k], first_order [B, F], dense [B, d] -> logits [B]."""
        logit = first_order.sum(1) + self.dense_first_order(dense).squeeze(-1)
        if self.cfg.kind == "deepfm":
            # FM pairwise interactions Σ_{i<j} <e_i, e_j> in O(F·k)
            logit = logit + 0.5 * (emb.sum(1).pow(2) - emb.pow(2).sum(1)).sum(1)
        deep = self.mlp(torch.cat([emb.flatten(1), dense], 1)).squeeze(-1)
        return logit + deep


def ctr_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of click logits against 0/1 labels."""
    return F.binary_cross_entropy_with_logits(logits, labels)
