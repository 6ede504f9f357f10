"""Context parallelism: each sequence split over the `cp` ranks, attention over the whole of it.

Chunking (causal load balance, as Megatron-LM's and torchtitan's context parallelism): the sequence
is cut into 2·cp equal chunks and cp rank r keeps chunks r and 2·cp-1-r, so that every rank holds
one early chunk (few keys to look at) and one late chunk (many): the causal work is even. Positions
(GPT's learned table, Llama's rotary angles) are the chunks' true ones (`SeqShard.positions`).

Attention over the whole sequence, two ways (`strategy.cp_method`):

- ring: every rank's keys/values reach every other rank, and each query chunk attends to the key
  chunks at or before it block by block, merging the blocks' softmaxes by their log-sum-exp
  (Liu et al. 2023, "Ring Attention"; the online softmax of Milakov & Gimelshein 2018). The keys
  and values travel in ONE all-gather per layer (torch's context_parallel offers the same as its
  `allgather` rotate method) rather than cp-1 send/recv steps: the bytes each rank receives are the
  same ((cp-1)/cp of the sequence's keys and values), without the overlap of a true ring.
- ulysses: an all-to-all turns q, k, v from sequence-sharded (all heads, 1/cp of the tokens) into
  head-sharded (1/cp of the heads, all the tokens), plain causal attention runs on whole sequences,
  and a second all-to-all turns the output back (Jacobs et al. 2023, "DeepSpeed Ulysses").

Both are differentiable: the ring's all-gather through `_GatherKV` (its backward an all-to-all of
the gradients, summed: a reduce-scatter's bytes, on every backend -- torch.distributed.nn.functional's
all-gather, used before, runs its gloo backward as scatters from the group's ranks taken as global
ranks: any cp group but the one holding ranks 0..cp-1 failed, "Global rank 0 is not part of group",
e.g. cp 2 × mp 2), ulysses' all-to-alls through the experts' differentiable exchange
(compat.all_to_all_autograd; the backward another all-to-all). Both compute in plain tensor ops (math
attention): torch's SDPA-based context_parallel does not run on a CPU.

The model asks for this through its attention and position modules' `seq` attribute (None: the
whole sequence is here); `apply_context_parallel` sets it. The loss of a rank is its chunks' mean;
with equal chunks, the mean over the cp group (what the gradient reduction and the logged loss
average) is the whole sequence's mean.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fleetwise.compat import all_to_all_autograd


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) that cp rank `rank` keeps: head and tail."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s chunks of `x` along `dim`, in the order of chunk_ids."""
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, cp)], dim)


def local_positions(seq_len: int, rank: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """The true positions of rank `rank`'s tokens in a sequence of `seq_len`."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(rank, cp)])


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_diagonal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [.., m, d] over one block of keys/values [.., n, d], in fp32: the output
    and the log-sum-exp of each query's scores [.., m, 1]. causal_diagonal: q and k are the same
    positions (a token sees itself and what precedes it)."""
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal_diagonal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v.float(), lse


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' attention of the same queries, as if their keys had been one block: each output
    weighted by its share of the total softmax mass, exp(lse_block - lse_total)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse) + out_b * torch.exp(lse_b - lse), lse


def chunked_attention(
    q_chunks: list[torch.Tensor],
    q_ids: Iterable[int],
    k_chunks: dict[int, torch.Tensor],
    v_chunks: dict[int, torch.Tensor],
    causal: bool,
) -> torch.Tensor:
    """Each query chunk (global chunk index in q_ids) over the key chunks it may see -- causal: those
    at or before it, the diagonal one masked -- merged block by block; the outputs concatenated
    along the sequence (dim -2), in q_chunks' order."""
    outs = []
    for qc, qi in zip(q_chunks, q_ids, strict=True):
        seen = range(qi + 1) if causal else sorted(k_chunks)
        out, lse = None, None
        for kj in seen:
            o, block_lse = block_attention(qc, k_chunks[kj], v_chunks[kj], causal and kj == qi)
            out, lse = (o, block_lse) if out is None else merge(out, lse, o, block_lse)
        outs.append(out)
    return torch.cat(outs, dim=-2)


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: query head i uses kv head i // (heads / kv_heads) (SDPA's enable_gqa)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


@dataclass
class SeqShard:
    """This rank's place in its cp group, and attention over the group's whole sequences."""

    group: dist.ProcessGroup
    rank: int
    cp: int
    method: str  # "ring" | "ulysses"

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return local_positions(local_len * self.cp, self.rank, self.cp, device)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunks of a [b, s, …] batch tensor."""
        return shard_sequence(x, self.rank, self.cp, dim=1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        """q [b, h, s_local, d], k and v [b, kv_heads, s_local, d] (this rank's chunks) -> the output
        of attention over the whole sequence for this rank's queries, [b, h, s_local, d], q's dtype."""
        if self.method == "ulysses":
            return self._ulysses(q, k, v, causal)
        return self._ring(q, k, v, causal)

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        c = q.shape[-2] // 2
        gathered = _GatherKV.apply(torch.stack((k, v)), self.group, self.cp)  # [cp, 2, b, kv, 2c, d]
        k_chunks: dict[int, torch.Tensor] = {}
        v_chunks: dict[int, torch.Tensor] = {}
        for j, kv in enumerate(gathered):
            for half, chunk in enumerate(chunk_ids(j, self.cp)):
                part = kv[..., half * c : (half + 1) * c, :]
                k_chunks[chunk] = _expand_kv(part[0], q.shape[1])
                v_chunks[chunk] = _expand_kv(part[1], q.shape[1])
        q_chunks = [q[..., :c, :], q[..., c:, :]]
        out = chunked_attention(q_chunks, chunk_ids(self.rank, self.cp), k_chunks, v_chunks, causal)
        return out.to(q.dtype)

    def _ulysses(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        order = self._natural_order(q.shape[-2], q.device)
        qs, ks, vs = (self._to_heads(x)[..., order, :] for x in (q, k, v))
        out = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=causal, enable_gqa=ks.shape[1] != qs.shape[1]
        )
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return self._to_sequence(out[..., back, :])

    def _natural_order(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Where each position of the whole sequence sits in the ranks' chunks laid end to end
        (rank 0's two chunks, rank 1's, …): an index that sorts them into sequence order."""
        laid = torch.cat([local_positions(local_len * self.cp, j, self.cp, device) for j in range(self.cp)])
        return torch.argsort(laid)

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[b, h, s_local, d] sequence-sharded -> [b, h/cp, s, d] head-sharded (the ranks' chunks in
        rank order along the sequence)."""
        b, h, s, d = x.shape
        send = x.reshape(b, self.cp, h // self.cp, s, d).transpose(0, 1).contiguous()
        recv = self._all_to_all(send)
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // self.cp, self.cp * s, d)

    def _all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """Row i of `send` [cp, ...] to cp rank i, differentiable: the experts' exchange
        (compat.all_to_all_autograd, models/moe.py) with even splits."""
        even = [1] * self.cp
        return all_to_all_autograd(send, even, even, self.group)

    def _to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of _to_heads: [b, h/cp, s, d] -> [b, h, s_local, d]."""
        b, hc, s, d = x.shape
        send = x.reshape(b, hc, self.cp, s // self.cp, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = self._all_to_all(send)
        return recv.transpose(0, 1).reshape(b, hc * self.cp, s // self.cp, d)


class _GatherKV(torch.autograd.Function):
    """Every cp rank's x, stacked in rank order [cp, ...]; backward: each rank's share of the stacked
    gradient sent back to it by one all-to-all and summed there (what a reduce-scatter computes;
    gloo has none over a subgroup that torch's own autograd all-gather gets right)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
        ctx.group = group
        out = torch.empty((cp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)  # (gloo: along dim 0 only)
        return out.view(cp, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mine = torch.empty_like(grad)  # row i: rank i's gradient of this rank's x
        dist.all_to_all_single(mine, grad.contiguous(), group=ctx.group)
        return mine.sum(0), None, None


def apply_context_parallel(parts: Iterable[nn.Module], group: dist.ProcessGroup, method: str) -> SeqShard:
    """Give every module that takes part (those with a `seq` attribute: attention, position tables)
    in this rank's model parts (its pipeline chunks, or the whole model) this rank's SeqShard;
    returns it (the trainer shards each batch with it, a pipeline's first stage included)."""
    shard = SeqShard(group, dist.get_rank(group), dist.get_world_size(group), method)
    for part in parts:
        for module in part.modules():
            if hasattr(module, "seq"):
                module.seq = shard
    return shard
