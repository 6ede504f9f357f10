"""The mixture-of-experts layer against a plain per-token loop written here (router, top-k, the
experts' SwiGLU, shared experts, capacity drops, the balance loss), its grouped-GEMM and loop paths
against each other, the balance loss's gradient, and what it counts under recompute."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from fleetwise.families.moe import MoE as MoEConfig
from fleetwise.models.moe import MoE

H, FFN, E = 16, 24, 4


def layer(seed: int = 0, **cfg) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(H, MoEConfig(num_experts=E, **cfg), FFN)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def reference(moe: MoE, x: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, list[int], int, float]:
    """Token by token, in float64: (output, tokens per expert, dropped slots, balance loss)."""
    k = cfg.get("top_k", 2)
    wg = moe.router.gate.weight.double()
    w1, w3, w2 = (w.double() for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2))
    flat = x.reshape(-1, H).double()
    tokens = flat.shape[0]
    capacity = math.ceil(cfg["capacity_factor"] * tokens * k / E) if cfg.get("capacity_factor") else None
    taken = [0] * E
    dropped = 0
    mean_scores = torch.zeros(E, dtype=torch.float64)
    out = torch.zeros_like(flat)
    for t in range(tokens):
        logits = wg @ flat[t]
        if cfg.get("score_func", "softmax") == "softmax":
            scores = torch.exp(logits - logits.max())
            scores = scores / scores.sum()
            normalised = scores
        else:
            scores = 1 / (1 + torch.exp(-logits))
            normalised = scores / scores.sum()
        mean_scores += normalised / tokens
        best = sorted(range(E), key=lambda i: -float(scores[i].detach()))[:k]
        weights = [float(scores[i].detach()) for i in best]
        if cfg.get("normalize_weights", True):
            weights = [w / sum(weights) for w in weights]
        for i, w in zip(best, weights, strict=True):
            taken[i] += 1
            if capacity is not None and taken[i] > capacity:
                dropped += 1
                continue
            hidden = (w1[i] @ flat[t]) * torch.sigmoid(w1[i] @ flat[t]) * (w3[i] @ flat[t])
            out[t] += w * (w2[i] @ hidden)
        if moe.shared is not None:
            s = moe.shared
            g, u = s.gate.weight.double() @ flat[t], s.up.weight.double() @ flat[t]
            out[t] += s.down.weight.double() @ (g * torch.sigmoid(g) * u)
    share = torch.tensor(taken, dtype=torch.float64) * E / (tokens * k)
    aux = cfg.get("aux_loss_coef", 0.01) * float((share * mean_scores).sum())
    return out.reshape(x.shape), taken, dropped, aux


CASES = {
    "top2_softmax_shared": {"top_k": 2, "num_shared_experts": 1},
    "top1_sigmoid": {"top_k": 1, "score_func": "sigmoid", "normalize_weights": False},
    "top3_sigmoid_normalised": {"top_k": 3, "score_func": "sigmoid"},
    "top2_capacity": {"top_k": 2, "capacity_factor": 0.5},
}


@pytest.mark.parametrize("name", list(CASES))
def test_layer_equals_a_per_token_loop(name):
    cfg = CASES[name]
    moe = layer(**cfg).train()
    x = torch.randn(2, 10, H, generator=torch.Generator().manual_seed(1))
    out = moe(x)
    want, taken, dropped, aux = reference(moe, x, cfg)
    assert torch.allclose(out.double(), want, atol=1e-5), (out.double() - want).abs().max()
    (stats,) = moe.take_stats()  # one forward
    assert stats[:E].tolist() == taken
    assert stats[E].item() == dropped
    assert stats[E + 1].item() == pytest.approx(aux, rel=1e-5)
    assert stats[E + 2].item() == 1  # one forward
    if "capacity_factor" in cfg:
        assert dropped > 0  # the case drops something (20 tokens × 2 slots, capacity 5 each)


def test_grouped_gemm_and_loop_give_the_same_numbers():
    from fleetwise.compat import grouped_mm_supported

    x = torch.randn(3, 8, H, generator=torch.Generator().manual_seed(2))
    results = []
    for grouped in (True, False):
        moe = layer(seed=3, top_k=2, num_shared_experts=1, grouped_mm=grouped).train()
        out = moe(x)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), {n: p.grad.clone() for n, p in moe.named_parameters()}))
    assert grouped_mm_supported(x.reshape(-1, H), moe.experts.w1)  # torch 2.13 CPU fp32: the kernel ran
    (a, ga), (b, gb) = results
    assert torch.allclose(a, b, atol=1e-6)
    assert all(torch.allclose(ga[n], gb[n], atol=1e-5) for n in ga)


def test_balance_loss_gradient_is_added_with_the_trainers_scale():
    """The block's output carries the balance loss: the router's gradient is the output loss's plus
    aux_grad_scale × the balance loss's."""
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(4))

    def router_grad(scale: float, with_aux: bool) -> torch.Tensor:
        moe = layer(
            seed=5,
            top_k=2,
            aux_loss_coef=0.5 if with_aux else 0.0,
            load_balance="aux_loss" if with_aux else "none",
        ).train()
        moe.aux_grad_scale = scale
        out = moe(x)
        out.pow(2).mean().backward()
        return moe.router.gate.weight.grad

    def aux_grad() -> torch.Tensor:
        moe = layer(seed=5, top_k=2, aux_loss_coef=0.5)
        flat = x.reshape(-1, H)
        _, chosen, scores = moe.router(flat)
        counts = torch.bincount(chosen.flatten(), minlength=E).double()
        (0.5 * (counts * E / (flat.shape[0] * 2) * scores.double().mean(0)).sum()).backward()
        return moe.router.gate.weight.grad

    plain = router_grad(1.0, with_aux=False)
    for scale in (1.0, 0.25):
        got = router_grad(scale, with_aux=True)
        assert torch.allclose(got, plain + scale * aux_grad(), atol=1e-6)


def test_recompute_does_not_count_twice_and_eval_counts_nothing():
    moe = layer(top_k=2).train()
    x = torch.randn(2, 5, H, requires_grad=True)
    # the whole forward again inside the backward (torch stops a recompute early by default, once
    # the last tensor backward needs is back: here that would skip the counting anyway)
    with set_checkpoint_early_stop(False):
        out = checkpoint(moe, x, use_reentrant=False)
        out.sum().backward()
    stats = moe.take_stats()
    assert len(stats) == 1 and stats[0, :E].sum().item() == 2 * 10  # one forward counted
    assert moe.take_stats() is None  # taken
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert moe.take_stats() is None


def test_bias_steers_the_choice_not_the_weights():
    moe = layer(top_k=1, load_balance="bias", normalize_weights=False).train()
    x = torch.randn(1, 8, H, generator=torch.Generator().manual_seed(6))
    flat = x.reshape(-1, H)
    weights, chosen, scores = moe.router(flat)
    with torch.no_grad():
        moe.router.expert_bias[2] = 100.0  # every token now picks expert 2 ...
    w2, c2, s2 = moe.router(flat)
    assert (c2 == 2).all() and not (chosen == 2).all()
    assert torch.equal(w2[:, 0], s2[:, 2]) and torch.equal(s2, scores)  # ... weighted by its own score
    assert torch.equal(F.softmax(moe.router.gate(flat), -1), scores)


# --- expert parallelism's bookkeeping (models/moe.py Dispatch), two ranks simulated by hand ------


def test_dispatch_groups_the_received_rows_by_local_expert_and_restores_their_order():
    """Two ranks, four experts (two each). Every row is tagged (source rank, global expert, index)
    and sorted by expert on its source as MoE.forward sorts them; the all-to-all is written out
    here (rank r gets, from each source in turn, the rows for its experts). On each rank the
    plan's order must give each local expert's rows together, source 0's first, in their order;
    its restore the arrival order back; the splits those the rows need."""
    from fleetwise.models.moe import Dispatch

    ep, experts, local = 2, 4, 2
    counts = {0: [3, 1, 0, 2], 1: [1, 2, 3, 4]}  # rows per global expert, on each source (one none)
    rows = {
        src: [(src, e, i) for e in range(experts) for i in range(counts[src][e])] for src in range(ep)
    }  # sorted by expert, as sent
    for rank in range(ep):
        mine = range(rank * local, (rank + 1) * local)
        received_counts = torch.tensor([counts[src][e] for src in range(ep) for e in mine])
        arrived = [row for src in range(ep) for row in rows[src] if row[1] in mine]  # source-major
        plan = Dispatch(torch.tensor(counts[rank]), received_counts, ep)
        assert plan.send_rows == [sum(counts[rank][:2]), sum(counts[rank][2:])]
        assert plan.recv_rows == [sum(counts[src][e] for e in mine) for src in range(ep)]
        assert plan.local_counts.tolist() == [counts[0][e] + counts[1][e] for e in mine]
        grouped = [arrived[i] for i in plan.order.tolist()]
        want = [(src, e, i) for e in mine for src in range(ep) for i in range(counts[src][e])]
        assert grouped == want
        assert [grouped[i] for i in plan.restore.tolist()] == arrived


def test_dispatch_with_no_rows_for_a_rank():
    from fleetwise.models.moe import Dispatch

    plan = Dispatch(torch.tensor([0, 0, 5, 1]), torch.tensor([0, 0, 0, 0]), 2)
    assert plan.send_rows == [0, 6] and plan.recv_rows == [0, 0]
    assert plan.order.numel() == 0 and plan.local_counts.tolist() == [0, 0]
