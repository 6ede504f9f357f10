"""The optimizer steps each DTensor parameter's local shard (runtime/optim.py `on_local_shards`):
the same update as torch's optimizer stepping the DTensors themselves, the state kept as DTensors
of the parameter's layout (checkpoints save and reshard them), a pending-sum gradient reduced first.
The multi-rank cases (a TP model's pending sums reduced over mp, FSDP shards, resharded resumes)
are the parity and checkpoint tables' (tests/integration)."""

from __future__ import annotations

import pytest
import torch
from helpers.config import compose
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

from fleetwise.runtime.optim import build_optimizer, build_scheduler


def sharded_model(mesh) -> tuple[nn.Module, nn.Parameter]:
    """An FSDP-sharded model (Shard(0) DTensor parameters) and a replicated DTensor weight beside
    it, whose gradient the test hands in as a pending sum (Partial), as sequence parallel leaves a
    norm weight's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    scale = nn.Parameter(distribute_tensor(torch.linspace(0.5, 1.5, 8), mesh, [Replicate()]))
    return model, scale


def train(opt_name: str, kernel: dict, local: bool, steps: int = 3):
    mesh = init_device_mesh("cpu", (1,))
    model, scale = sharded_model(mesh)
    cfg, _ = compose("recipe=gpt/tiny", f"optim={opt_name}")
    params = [*model.parameters(), scale]
    opt = build_optimizer(params, cfg.optim, kernel)
    if not local:
        del opt.step  # torch's own step, on the DTensors
    sched = build_scheduler(opt, cfg.optim, cfg.train)  # it re-binds opt.step: ours must survive it
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(8, 16, generator=data)).pow(2).mean().backward()
        scale.grad = DTensor.from_local(torch.randn(8, generator=data), mesh, [Partial()])
        opt.step()
        sched.step()
        opt.zero_grad()
    return params, opt


@pytest.mark.parametrize(
    ("opt_name", "kernel"), [("adamw", {}), ("adamw", {"foreach": True}), ("sgd", {}), ("adagrad", {})]
)
def test_stepping_local_shards_equals_stepping_the_dtensors(gloo_world_of_one, opt_name, kernel):
    (got, opt), (want, ref) = train(opt_name, kernel, local=True), train(opt_name, kernel, local=False)
    for a, b in zip(got, want, strict=True):
        assert isinstance(a, DTensor) and a.placements == b.placements
        assert torch.equal(a.to_local(), b.to_local())
    moved = train(opt_name, kernel, local=True, steps=0)[0]
    assert any(not torch.equal(a.to_local(), b.to_local()) for a, b in zip(got, moved, strict=True))
    for p, q in zip(got, want, strict=True):
        mine, theirs = opt.state[p], ref.state[q]
        assert mine.keys() == theirs.keys() and mine
        for k, v in mine.items():
            if isinstance(theirs[k], DTensor):  # moments, momentum buffers: the parameter's layout
                assert isinstance(v, DTensor) and v.placements == p.placements and v.shape == p.shape
                assert torch.equal(v.to_local(), theirs[k].to_local()), k
            else:  # the step counter
                assert not isinstance(v, DTensor) and torch.equal(v, theirs[k]), k
    assert not any(not isinstance(p, DTensor) for p in opt.state)  # no local shard left keyed in it


def test_the_state_round_trips_a_checkpoint_and_steps_on(gloo_world_of_one):
    params, opt = train("adamw", {}, local=True)
    saved = opt.state_dict()
    assert all(isinstance(v, DTensor) for st in saved["state"].values() for k, v in st.items() if k != "step")
    fresh = build_optimizer(params, compose("recipe=gpt/tiny")[0].optim)
    fresh.load_state_dict(saved)
    for p in params:
        p.grad = torch.ones_like(p)
    fresh.step()
    for p in params:
        assert fresh.state[p]["step"].item() == 4


def test_the_fused_kernel_keeps_dtensors_own_step(gloo_world_of_one):
    """A GPU job's offloaded shards step with the fused kernel (runtime/optim.py `step_kernel`),
    which takes GradScaler's device flags and checks every tensor's device: DTensor's own step
    (tests/integration/test_cuda_semantics.py runs those jobs)."""
    model, scale = sharded_model(init_device_mesh("cpu", (1,)))
    params = [*model.parameters(), scale]
    optim = compose("recipe=gpt/tiny")[0].optim
    assert "step" not in vars(build_optimizer(params, optim, {"fused": True}))
    assert "step" in vars(build_optimizer(params, optim, {"foreach": True}))
