"""The mixture-of-experts layer (its config and rules: fleetwise.families.moe): a router, routed
SwiGLU experts run as one grouped GEMM (or a loop), optional shared experts.

tokens x [T, h] -> router scores [T, E] (fp32) -> the top_k experts of each token (chosen on the
scores plus the load-balancing bias, weighted by the scores alone) -> the (token, slot) pairs
sorted by expert (stable: token order within an expert) -> each expert's SwiGLU on its rows ->
weighted and summed back onto their tokens (index_add) -> + the shared experts' SwiGLU of x.

Dropless by default: every row is computed, so a token's output does not depend on the other
tokens of its micro-batch and every layout computes the same numbers. With a capacity factor,
the rows beyond an expert's capacity get weight 0 (dropped: their token keeps its residual and its
other experts) and are counted.

The auxiliary loss reaches the gradients without passing through the trainer's loss: the block's
output carries it (`_AddAuxLoss`, an identity whose backward hands the loss its gradient,
DeepSeek's and torchtitan's device), so it works under pipeline parallelism, where the loss is
computed on another rank, and under activation recompute. The gradient it hands is
`aux_grad_scale`: the trainer sets it to the scale its own loss's gradient carries (1 / micro-
batches, fp16's loss scale: runtime/moe.py).

What the trainer reports (runtime/moe.py) is kept in `stats`, a row per forward: tokens per expert,
dropped slots, the auxiliary loss and 1 (the forward) -- not during a recompute, which runs the
forward again inside the backward.

Parallel code stays outside, as for the dense blocks: FSDP shards the experts' [E, out, in]
weights along the experts like any parameter. Tensor parallelism does not split the layer
(runtime/parallelize.py leaves a MoE block's MLP out of the plan): without sequence parallelism
every mp rank holds the same tokens here, so it routes them and runs every expert (or its ep
shard of them) as one process would, and the gradients of the router and experts come out equal
on every mp rank with no reduction, like the norms'. Chosen over torchtitan's (the mp ranks join
the expert group, each routing a sequence shard) because it needs no new collective, keeps
dropless routing layout invariant with nothing to prove, and the experts can still be split by
ep and FSDP; its price is the MoE MLP's compute and memory repeated on every mp rank (the
planner counts them so). Sequence parallelism with experts is refused (config/rules/moe.py).
Expert parallelism
(runtime/expert_parallel.py) makes the experts' weights DTensors sharded along the experts over an
expert-parallel group and sets `ep_group`: the sorted rows then travel to the rank that holds
their expert and back (`Dispatch`: two variable-split all-to-alls, the autograd form), and each
rank runs only its own experts on the rows every rank of the group sent it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fleetwise.compat import all_to_all_autograd, grouped_mm, grouped_mm_supported, in_backward, is_fake
from fleetwise.models.transformer import SwiGLU

# `cfg` below is the model.moe section (fleetwise.families.moe.MoE; models/ sits below families/
# in the import order, so it is read by its fields here)
MoEConfig = Any

STAT_DROPPED, STAT_AUX, STAT_FORWARDS = -3, -2, -1  # the last columns of a `stats` row, after the experts'


class Router(nn.Module):
    """Scores of every expert for every token, the top_k chosen and their weights."""

    def __init__(self, hidden: int, cfg: MoEConfig):
        super().__init__()
        self.top_k, self.softmax, self.normalize = (
            cfg.top_k,
            cfg.score_func == "softmax",
            cfg.normalize_weights,
        )
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=False)
        # DeepSeek-V3's balancing bias: a buffer (no gradient), the same on every rank (the trainer
        # moves it from the step's token counts over the whole job), saved in checkpoints
        self.expert_bias: torch.Tensor | None
        self.register_buffer(
            "expert_bias", torch.zeros(cfg.num_experts) if cfg.load_balance == "bias" else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, h] -> (weights [T, k] fp32, chosen experts [T, k] int64, scores [T, E] fp32)."""
        logits = self.gate(x).float()
        scores = torch.softmax(logits, dim=-1) if self.softmax else torch.sigmoid(logits)
        choice = scores.detach()  # the choice is not differentiable; only the weights are
        if self.expert_bias is not None:
            choice = choice + self.expert_bias
        chosen = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen, scores


def expert_matmul(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor, grouped: bool
):
    """Rows of x grouped by expert (counts[e] rows of expert e, in order) times w[e]ᵀ: [N, in] with
    w [E, out, in] -> [N, out]."""
    if is_fake(x):
        # the dry run's tensors hold no counts: the balanced split the planner assumes, as one bmm
        # (the same FLOPs and saved tensors as the grouped GEMM)
        return _balanced(x, w)
    if grouped and grouped_mm_supported(x, w):
        return grouped_mm(x, w, offsets)
    return expert_loop(x, w, counts)


def expert_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM as one matmul per expert (reads the counts on the host)."""
    chunks = x.split(counts.tolist())
    return torch.cat([F.linear(chunk, w[e]) for e, chunk in enumerate(chunks)])


def _balanced(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n, e = x.shape[0], w.shape[0]
    if n % e == 0:
        return torch.bmm(x.view(e, n // e, -1), w.transpose(-2, -1)).view(n, -1)
    sizes = [n // e + (1 if i < n % e else 0) for i in range(e)]
    return torch.cat([F.linear(chunk, w[i]) for i, chunk in enumerate(x.split(sizes))])


class GroupedExperts(nn.Module):
    """E SwiGLU experts with their weights stacked: w1 (gate) and w3 (up) [E, f, h], w2 (down)
    [E, h, f] -- each expert's slice laid out as an nn.Linear weight (Mixtral's w1, w3, w2)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, grouped: bool):
        super().__init__()
        self.grouped = grouped
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: rows grouped by this module's experts (counts[e] rows of expert e; under expert
        parallelism the local experts, whose weights are the local shards)."""
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # where each expert's rows end

        def mm(a, w):
            return expert_matmul(a, _local(w), counts, offsets, self.grouped)

        return mm(F.silu(mm(x, self.w1)) * mm(x, self.w3), self.w2)


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of an expert-parallel weight (differentiable: its gradient is the
    DTensor's local gradient), or the weight itself."""
    return w.to_local() if isinstance(w, DTensor) else w


class Dispatch:
    """Where the rows of one expert-parallel forward go and come back from (the bookkeeping of
    `MoE.exchange`, no communication): from the expert counts this rank sends, `sent` [E] (its
    rows sorted by global expert), and those it receives, `received` [ep · L] (L = E / ep local
    experts; source-major: source rank 0's counts of the local experts, then rank 1's, …).

    The received rows arrive source-major; the experts want them expert-major (each local expert's
    rows together, from source 0 first): `order` is that permutation, `restore` its inverse."""

    def __init__(self, sent: torch.Tensor, received: torch.Tensor, ep: int):
        local = received.numel() // ep
        self.send_rows = sent.view(ep, -1).sum(1).tolist()  # to each rank of the group
        blocks = received.view(ep, local)  # [source, local expert]
        self.recv_rows = blocks.sum(1).tolist()  # from each rank of the group
        self.local_counts = blocks.sum(0)  # rows of each local expert, all sources together
        flat = blocks.reshape(-1)
        src_start = (torch.cumsum(flat, 0) - flat).view(ep, local)  # each block's source-major start
        sizes = blocks.t().reshape(-1)  # the blocks in expert-major order
        starts = src_start.t().reshape(-1)
        dst_start = torch.cumsum(sizes, 0) - sizes
        total = int(flat.sum())
        self.order = torch.repeat_interleave(starts - dst_start, sizes, output_size=total) + torch.arange(
            total, device=flat.device
        )
        self.restore = torch.empty_like(self.order)
        self.restore[self.order] = torch.arange(total, device=flat.device)


class _AddAuxLoss(torch.autograd.Function):
    """out, unchanged; in backward the auxiliary loss gets the gradient `scale` (the trainer's loss
    scale), as if it had been added to the loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.dtype = scale, aux.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=ctx.dtype, device=grad.device), None


class MoE(nn.Module):
    """The MLP of a MoE block: routed experts (+ shared experts), [b, s, h] -> [b, s, h]."""

    def __init__(self, hidden: int, cfg: MoEConfig, ffn: int):
        """ffn: the width of one expert."""
        super().__init__()
        f = ffn
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.aux_coef = cfg.aux_loss_coef if cfg.load_balance == "aux_loss" else 0.0
        self.router = Router(hidden, cfg)
        self.experts = GroupedExperts(cfg.num_experts, hidden, f, cfg.grouped_mm)
        self.shared = SwiGLU(hidden, cfg.num_shared_experts * f) if cfg.num_shared_experts else None
        self.aux_grad_scale = 1.0  # set by the trainer (runtime/moe.py)
        self.ep_group: dist.ProcessGroup | None = None  # set by runtime/expert_parallel.py
        self.stats: list[torch.Tensor] = []  # a row [E + 3] per forward since the trainer took them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        tokens, e, k = flat.shape[0], self.num_experts, self.top_k
        weights, chosen, scores = self.router(flat)
        # (the balance loss first: what backward needs of the block's last ops -- the shared
        # experts' -- ends the recompute of a checkpointed block, before their down projection)
        aux = self.balance_loss(scores, chosen, tokens) if self.aux_coef else None
        slots = chosen.reshape(-1)  # the expert of each (token, slot), token-major
        counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(
            0, slots, torch.ones_like(slots)
        )
        order = torch.argsort(slots, stable=True)  # slots grouped by expert, in token order
        token = order // k
        slot_weights = weights.reshape(-1)[order]
        dropped = None
        if self.capacity_factor is not None:
            kept, dropped = _within_capacity(counts, slots[order], self.capacity(tokens))
            slot_weights = slot_weights * kept
        if self.ep_group is None:
            rows = self.experts(flat[token], counts)
        else:
            rows = self.exchange(flat[token], counts)
        out = torch.zeros_like(flat, dtype=rows.dtype).index_add(
            0, token, rows * slot_weights.unsqueeze(-1).to(rows.dtype)
        )
        if self.shared is not None:
            out = out + self.shared(flat)
        out = out.view(shape)
        if self.training and not in_backward():  # (a recompute runs inside the backward)
            self.record_counts(counts, dropped, aux)
        if aux is not None and aux.requires_grad:
            out = _AddAuxLoss.apply(out, aux, self.aux_grad_scale)
        return out

    def exchange(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' output of `rows` (sorted by global expert, counts[e] of expert e) under
        expert parallelism: each row to the rank that holds its expert, through the local experts,
        and back in the order it left (the rows a capacity drops travel too, with weight 0)."""
        group = self.ep_group
        ep = dist.get_world_size(group)
        local = self.num_experts // ep
        if is_fake(rows):
            # the dry run's tensors hold no counts: the balanced split the planner assumes
            n = rows.shape[0]
            even = [n // ep + (1 if i < n % ep else 0) for i in range(ep)]
            got = _all_to_all(rows, even, even, group)
            out = self.experts(got, counts.new_full((local,), n // self.num_experts))
            return _all_to_all(out, even, even, group)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # [E]: from each source, per local expert
        plan = Dispatch(counts, received, ep)
        got = _all_to_all(rows, plan.recv_rows, plan.send_rows, group)
        out = self.experts(got[plan.order], plan.local_counts)
        return _all_to_all(out[plan.restore], plan.send_rows, plan.recv_rows, group)

    def capacity(self, tokens: int) -> int:
        assert self.capacity_factor is not None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def balance_loss(self, scores: torch.Tensor, chosen: torch.Tensor, tokens: int) -> torch.Tensor:
        """coef · Σ_i f_i · P_i: f_i = the slots expert i got · E / (tokens · k) (no gradient), P_i
        the mean of expert i's normalised score (sigmoid scores are normalised per token)."""
        if not self.router.softmax:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        slots = chosen.reshape(-1)
        counts = torch.zeros(self.num_experts, device=scores.device).index_add_(
            0, slots, torch.ones(slots.shape, device=scores.device)
        )
        share = counts * (self.num_experts / (tokens * self.top_k))
        return self.aux_coef * (share * scores.mean(dim=0)).sum()

    @torch.no_grad()
    def record_counts(
        self, counts: torch.Tensor, dropped: torch.Tensor | None, aux: torch.Tensor | None
    ) -> None:
        zero = counts.new_zeros((), dtype=torch.float32)
        extra = torch.stack(
            [
                dropped.float() if dropped is not None else zero,
                aux.detach().float() if aux is not None else zero,
                torch.ones_like(zero),
            ]
        )
        row = torch.cat([counts.float(), extra])
        self.stats.append(row)

    def take_stats(self) -> torch.Tensor | None:
        """The rows of the forwards since the last call, [forwards, E + 3] (None: no forward ran),
        and start again."""
        stats, self.stats = self.stats, []
        return torch.stack(stats) if stats else None


def _within_capacity(
    counts: torch.Tensor, sorted_experts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(1.0 for the sorted slots within their expert's first `capacity`, else 0.0; how many are
    not), from the position of each slot in its expert's run."""
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(sorted_experts.numel(), device=counts.device) - starts[sorted_experts]
    kept = position < capacity
    return kept.float(), (~kept).sum()


def _all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    """x's rows, send[i] of them to rank i of the group, as the rows received (recv[i] from rank i):
    the autograd form, whose backward sends the gradients back the same way."""
    return all_to_all_autograd(x.contiguous(), recv, send, group)
