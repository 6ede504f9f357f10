"""The vocabulary-parallel embedding (models/tp_plan.py `VocabParallelEmbedding`): each mp rank
looks its own rows up and its gradient is those rows only, Shard(0) like the weight. DTensor's
own embedding backward (torch's RowwiseParallel) made the whole (v, h) gradient on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn


@pytest.fixture
def fake_world_rank_1():
    """This process as rank 1 of 2 in torch's fake process group: collectives do nothing, so an
    all-reduce leaves this rank's own partial sum -- exactly what this rank computed."""
    from fleetwise.dryrun.patches import FakeStore  # torch's testing store, behind the dry run's door

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    yield
    dist.destroy_process_group()


def test_each_rank_computes_and_keeps_only_its_rows_of_the_gradient(fake_world_rank_1):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from fleetwise.models.tp_plan import VocabParallelEmbedding

    v, h = 11, 4  # uneven: rank 0 holds rows 0-5, rank 1 rows 6-10
    table = torch.arange(v * h, dtype=torch.float32).reshape(v, h) + 1
    emb = nn.Embedding(v, h)
    parallelize_module(emb, init_device_mesh("cpu", (2,)), VocabParallelEmbedding())
    assert isinstance(emb.weight, DTensor) and emb.weight.placements == (Shard(0),)
    with torch.no_grad():
        emb.weight.to_local().copy_(table[6:])

    tokens = torch.tensor([[0, 6, 10, 3, 6]])
    out = emb(tokens)
    assert not isinstance(out, DTensor) and out.shape == (1, 5, h)
    # this rank's partial sum: its rows where the token is its own, zero elsewhere
    want = torch.stack([torch.zeros(h), table[6], table[10], torch.zeros(h), table[6]])
    assert torch.equal(out[0], want)

    (out * torch.arange(1, 6).reshape(1, 5, 1)).sum().backward()
    grad = emb.weight.grad
    assert isinstance(grad, DTensor) and grad.placements == (Shard(0),)
    local = grad.to_local()
    assert local.shape == (5, h)  # rows 6-10 only, never the whole vocabulary
    # row 6 (local 0): positions 2 and 5; row 10 (local 4): position 3. Tokens 0 and 3 are another
    # rank's: masked to local row 0 for the lookup, their gradient must not land there
    want_grad = torch.zeros(5, h)
    want_grad[0] = 2 + 5
    want_grad[4] = 3
    assert torch.equal(local, want_grad)
