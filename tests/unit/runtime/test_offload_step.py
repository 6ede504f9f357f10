"""The optimizer step of a GPU job's offloaded shards (FSDP's CPUOffloadPolicy) runs on the host
with torch's fused CPU AdamW (runtime/optim.py `step_kernel`): the multi-tensor step, which the
job's device would pick, made a temporary per parameter in host memory (97 ms a step with 23k
page faults against 15 ms fused, AdamW over 12 x 8 MiB tensors). The kernels must agree, and
GradScaler's overflow flag must still skip a step (tests/integration/test_cuda_semantics.py
checks that the trainer of an offloaded job builds the fused one)."""

from __future__ import annotations

import torch
from helpers.config import compose
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from fleetwise.runtime.optim import build_optimizer, step_kernel


def test_offloaded_adamw_steps_with_the_fused_kernel_and_elsewhere_as_before():
    assert step_kernel("cuda", True, "adamw") == {"fused": True}
    assert step_kernel("cuda", False, "adamw") == {"foreach": True}
    # DTensor has no sharding rule for fused SGD and Adagrad (torch 2.13): they keep foreach
    assert step_kernel("cuda", True, "sgd") == step_kernel("cuda", True, "adagrad") == {"foreach": True}
    assert step_kernel("cpu", True, "adamw") == {}  # a CPU job: torch's choice, as before


def offloaded_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))


def test_fused_and_multi_tensor_adamw_agree_on_offloaded_shards(gloo_world_of_one):
    cfg, _ = compose("recipe=gpt/tiny")
    after = {}
    for name, kernel in (("fused", step_kernel("cuda", True, "adamw")), ("foreach", {"foreach": True})):
        model = offloaded_model()
        params = [p for p in model.parameters()]
        opt = build_optimizer(params, cfg.optim, kernel)
        assert opt.defaults.get(name) is True
        assert all(p.device.type == "cpu" for p in params)  # host shards (DTensors)
        data = torch.Generator().manual_seed(1)
        for _ in range(5):
            model(torch.randn(8, 16, generator=data)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        after[name] = [p.full_tensor().clone() for p in params]
    worst = max((a - b).abs().max().item() for a, b in zip(after["fused"], after["foreach"], strict=True))
    assert worst < 1e-6, worst  # fp32 rounding (measured 3e-8)
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(
            after["fused"], [p.full_tensor() for p in offloaded_model().parameters()], strict=True
        )
    )
    assert moved > 1e-3  # the steps did update


def test_gradscaler_on_the_host_skips_an_overflowing_fused_step():
    """An offloaded fp16 job keeps its GradScaler's scale on the host, beside the gradients
    (runtime/trainer.py): the fused kernel reads the overflow flag there and skips the update."""
    cfg, _ = compose("recipe=gpt/tiny")
    model = nn.Linear(4, 4)
    opt = build_optimizer(list(model.parameters()), cfg.optim, step_kernel("cuda", True, "adamw"))
    scaler = torch.amp.GradScaler("cpu")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(2, 4)).sum() * float("inf")).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 2.0**15  # backed off from 2^16
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
