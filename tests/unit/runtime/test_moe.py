"""The trainer's expert monitor on one rank: a step's counts taken from the MoE blocks (its
micro-batches' forwards, not the pipeline stage's shape-learning one), the
auxiliary-loss-free bias update (DeepSeek-V3's sign rule, by hand), the balance losses' gradient
scale handed to every block, and the moe/* metrics of each step since the last read."""

from __future__ import annotations

import pytest
import torch
from helpers.config import compose


def test_monitor_counts_moves_biases_and_reports_each_step():
    from fleetwise.models.moe import MoE
    from fleetwise.runtime.modeling import build_model
    from fleetwise.runtime.moe import ExpertMonitor

    cfg, problems = compose(
        "recipe=llama/moe_tiny", "model.moe.load_balance=bias", "model.moe.bias_update_rate=0.5"
    )
    assert problems == []
    model = build_model(cfg).train()
    monitor = ExpertMonitor(
        [model], cfg.model.moe, cfg.model.num_layers, 1, torch.device("cpu"), world_size=1
    )
    assert [layer for layer, _ in monitor.layers] == [1, 2, 3]  # block 0 is dense
    monitor.set_grad_scale(0.125)
    assert all(m.aux_grad_scale == 0.125 for m in model.modules() if isinstance(m, MoE))

    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    inputs = {}  # each MoE block's input in the step's forward
    for layer, m in monitor.layers:
        m.register_forward_hook(lambda mod, args, out, layer=layer: inputs.__setitem__(layer, args[0]))
    counts = []
    for i in range(2):  # two steps, one micro-batch each
        if i == 0:  # a pipeline stage's shape-learning forward at the first step: not counted
            model(torch.zeros_like(tokens))
        model(tokens).sum().backward()
        step = {}  # tokens per expert, by hand: top-2 of the softmax scores plus the bias
        for layer, m in monitor.layers:
            x = inputs[layer].reshape(-1, 64).detach()
            top = (
                (torch.softmax(x @ m.router.gate.weight.detach().T, -1) + m.router.expert_bias)
                .topk(2)
                .indices
            )
            step[layer] = torch.bincount(top.flatten(), minlength=4).float()
        before = {layer: m.router.expert_bias.clone() for layer, m in monitor.layers}
        monitor.after_backward()
        for layer, m in monitor.layers:
            delta = 0.5 * torch.sign(step[layer].mean() - step[layer])
            assert torch.equal(m.router.expert_bias, before[layer] + delta - delta.mean())
        counts.append(step)

    records = monitor.read()
    assert len(records) == 2 and monitor.read() == []
    for record, step in zip(records, counts, strict=True):
        for layer in (1, 2, 3):
            assert [record[f"moe/layer{layer}/tokens_expert{e}"] for e in range(4)] == step[layer].tolist()
            want = (step[layer].max() / step[layer].mean()).item()
            assert record[f"moe/layer{layer}/load_max_over_mean"] == pytest.approx(want)
        # 2 samples × 32 tokens × 2 slots over 4 experts: 32 a expert at balance
        assert record["moe/load_max_over_mean"] == pytest.approx(
            max(s.max().item() for s in step.values()) / 32
        )
        assert record["moe/dropped_tokens"] == 0 and record["moe/aux_loss"] == 0  # no balance loss with bias
        assert "moe/layer0/load_max_over_mean" not in record
