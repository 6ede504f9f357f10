"""DDP's gradients between steps (runtime/optim.py `Optimizers.zero_grad`): zeroed in place in
its buckets under gradient accumulation (micro-batches add into them; no second set of
gradients), set to None without accumulation (no memset of every gradient each step)."""

from __future__ import annotations

import pytest
import torch
from helpers.config import compose
from torch import nn


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_ddp_gradients_are_kept_in_the_buckets_only_when_micro_batches_add_into_them(
    gloo_world_of_one, micro_batches
):
    from torch.nn.parallel import DistributedDataParallel

    from fleetwise.runtime.optim import Optimizers

    cfg, problems = compose(
        "recipe=gpt/tiny", "optim=sgd", "hardware.devices_per_node=1", "train.global_batch_size=4",
        f"train.micro_batch_size={4 // micro_batches}",
    )  # fmt: skip
    assert problems == [] and cfg.train.accumulate_steps == micro_batches
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)), gradient_as_bucket_view=True
    )
    opts = Optimizers([model], cfg.optim, cfg.train)
    for _ in range(2):  # the second step: DDP's buckets exist, the gradients were views of them
        for i in range(micro_batches):
            with model.no_sync() if i < micro_batches - 1 else torch.enable_grad():
                model(torch.randn(4, 8)).sum().backward()
        opts.step()
        opts.zero_grad()
    grads = [p.grad for p in model.parameters()]
    if micro_batches == 1:
        assert all(g is None for g in grads)
    else:
        assert all(g is not None and not g.any() for g in grads)
        # still DDP's bucket views (one bucket for these few parameters, every gradient a slice of
        # its storage): the next micro-batches accumulate there
        assert model.reducer is not None and len({g.untyped_storage().data_ptr() for g in grads}) == 1
        assert all(g.untyped_storage().nbytes() > g.numel() * g.element_size() for g in grads)
