"""CTR model and synthetic click data: parameter accounting, determinism, id skew."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.config import compose

from fleetwise.families import total_params
from fleetwise.families.ctr.data import SyntheticClicks, rank_micro_batches, step_indices
from fleetwise.families.ctr.model import TABLE_CHUNK_ROWS, CTRNet, ctr_loss, table_init
from fleetwise.families.ctr.units import parameter_shapes as ctr_parameter_shapes


def ctr_cfg(*overrides: str):
    cfg, problems = compose("recipe=ctr/tiny", *overrides)
    assert cfg is not None, problems
    return cfg


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model.kind=wide_deep",),
        ("model.num_dense_features=0", "model.mlp_hidden=[7]", "model.embedding_dim=3"),
        (
            "recipe=ctr/deepfm_criteo",
            "model.sparse_tables=[{name:a,num_embeddings:11},{name:b,num_embeddings:5}]",
        ),
    ],
)
def test_parameter_count_names_and_shapes_match_the_planner(overrides):
    cfg = ctr_cfg(*overrides)
    model = CTRNet(cfg.model, seed=1)
    assert sum(p.numel() for p in model.parameters()) == total_params(cfg.model)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == ctr_parameter_shapes(cfg.model)


def test_forward_equals_forward_rows_and_deepfm_adds_the_pairwise_term():
    cfg = ctr_cfg()
    model = CTRNet(cfg.model, seed=3)
    batch = SyntheticClicks(cfg.model, cfg.data).batch(np.arange(16))
    emb, first = model.lookup(batch["sparse_ids"])
    assert emb.shape == (16, 4, 8) and first.shape == (16, 4)
    logits = model(batch["sparse_ids"], batch["dense"])
    assert logits.shape == (16,)
    torch.testing.assert_close(logits, model.forward_rows(emb, first, batch["dense"]))
    # FM second-order term against the explicit sum over field pairs
    pairs = sum((emb[:, i] * emb[:, j]).sum(1) for i in range(4) for j in range(i + 1, 4))
    wide = CTRNet(cfg.model.model_copy(update={"kind": "wide_deep"}), seed=3)
    torch.testing.assert_close(logits - wide(batch["sparse_ids"], batch["dense"]), pairs)
    expected = torch.nn.functional.binary_cross_entropy(torch.sigmoid(logits), batch["labels"])
    torch.testing.assert_close(ctr_loss(logits, batch["labels"]), expected)


def test_init_is_deterministic_and_a_server_can_build_only_its_rows():
    cfg = ctr_cfg()
    a, b, c = CTRNet(cfg.model, seed=5), CTRNet(cfg.model, seed=5), CTRNet(cfg.model, seed=6)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q), n
        assert not torch.equal(p, r), n
    # no seed: torch's current seed (the collective runtime seeds with train.seed first)
    torch.manual_seed(5)
    assert torch.equal(CTRNet(cfg.model).mlp[0].weight, a.mlp[0].weight)
    # remote tables: the distributed tables are left out, the rest is identical
    remote = CTRNet(cfg.model, seed=5, remote_tables=True)
    assert not list(remote.embeddings) and sum(p.numel() for p in remote.parameters()) < 2000
    assert torch.equal(remote.mlp[0].weight, a.mlp[0].weight)
    # a table longer than one init chunk: strided rows equal the rows of the whole table
    n = TABLE_CHUNK_ROWS + 1000
    whole = table_init(7, 2, n, 3)
    rows = torch.arange(1, n, 3)
    assert torch.equal(table_init(7, 2, n, 3, rows), whole[rows])
    full = table_init(5, 0, 5000, 9)
    assert torch.equal(a.embeddings["user_id"].weight.detach(), full[:, :8])
    assert torch.equal(a.first_order["user_id"].weight.detach(), full[:, 8:])


def test_samples_depend_only_on_their_global_index():
    cfg = ctr_cfg()
    data = SyntheticClicks(cfg.model, cfg.data)
    idx = np.arange(100, 164)
    whole = data.batch(idx)
    parts = [data.batch(idx[i : i + 16]) for i in range(0, 64, 16)]
    shuffled = data.batch(idx[::-1].copy())
    for key in ("sparse_ids", "dense", "labels"):
        assert torch.equal(whole[key], torch.cat([p[key] for p in parts]))
        assert torch.equal(whole[key], shuffled[key].flip(0))
    assert whole["sparse_ids"].dtype == torch.int64 and whole["dense"].dtype == torch.float32
    assert whole["labels"].dtype == torch.float32 and set(whole["labels"].tolist()) <= {0.0, 1.0}
    again = SyntheticClicks(cfg.model, cfg.data).batch(idx)
    assert torch.equal(again["sparse_ids"], whole["sparse_ids"])


def test_trainers_split_the_global_batch_into_contiguous_micro_batches():
    # step 3 of G=64 over 2 trainers × 2 micro-batches of 16, wrapping at num_samples=200
    micro = [rank_micro_batches(3, t, 2, 64, 16, 200) for t in range(2)]
    assert [len(m) for m in micro] == [2, 2]
    assert np.array_equal(np.concatenate(micro[0] + micro[1]), step_indices(3, 64, 200))
    assert np.array_equal(step_indices(3, 64, 200), np.arange(192, 256) % 200)


def test_ids_follow_a_zipf_law_scattered_over_the_table():
    cfg = ctr_cfg("data.zipf_alpha=1.2")
    data = SyntheticClicks(cfg.model, cfg.data)
    ids = data.ids(0, np.arange(200_000))  # user_id: 5000 rows
    assert ids.min() >= 0 and ids.max() < 5000
    counts = np.sort(np.bincount(ids, minlength=5000))[::-1]
    p = np.arange(1, 5001, dtype=float) ** -1.2
    p /= p.sum()
    # the most popular ids appear as often as the truncated Zipf law says
    assert counts[:3] / 200_000 == pytest.approx(p[:3], rel=0.05)
    # popular ids are not simply the first rows of the table
    top = np.argsort(np.bincount(ids, minlength=5000))[::-1][:10]
    assert top.max() > 100


def test_labels_carry_signal_a_model_can_learn():
    cfg = ctr_cfg()
    data = SyntheticClicks(cfg.model, cfg.data)
    b = data.batch(np.arange(20_000))
    y = b["labels"].numpy()
    assert 0.2 < y.mean() < 0.8
    teacher = sum(data.teacher_weight(f, b["sparse_ids"][:, f].numpy()) for f in range(4))
    assert np.corrcoef(teacher, y)[0, 1] > 0.2
