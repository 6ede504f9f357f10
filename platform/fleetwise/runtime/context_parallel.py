"""Context parallelism: each sequence split over the `cp` ranks, attention over the whole of it.

Chunking (causal load balance, as Megatron-LM's and torchtitan's context parallelism): the sequence
is cut into 2·cp equal chunks and cp rank r keeps chunks r and 2·cp-1-r, so that every rank holds
one early chunk (few keys to look at) and one late chunk (many): the causal work is even. Positions
(GPT's learned table, Llama's rotary angles) are the chunks' true ones (`SeqShard.positions`).

Attention over the whole sequence, two ways (`strategy.cp_method`):

- ring: the ranks pass their keys/values around the ring, cp steps: at step t a rank holds the block
  of the rank t places before it and attends its two query chunks to that block's two key chunks
  -- a key chunk after the query chunk is skipped (causal), the same chunk is the causal diagonal,
  an earlier one is full -- merging the blocks' softmaxes by their log-sum-exp, in fp32 (Liu et
  al. 2023, "Ring Attention"; the online softmax of Milakov & Gimelshein 2018). The next block's
  send/receive (batch_isend_irecv to the next cp rank, from the one before: `_Ring`) starts before
  the block in hand is computed and is waited for only after it, so the transfer hides behind that
  block's attention where the compute is the longer (plan/context_parallel.py counts the rest).
  Head-tail chunking gives every rank 2·cp + 1 of the (2·cp)² chunk pairs to compute.
  Backward: written by hand (`_RingAttention`, FlashAttention's backward block by block), not a
  differentiable rotate: autograd would keep every block it received saved for the backward --
  the whole sequence's keys/values, and each block's scores -- where the hand-written backward
  passes the keys/values around the ring again, recomputes each block's probabilities from the
  saved log-sum-exp, and sends each block's dK/dV (fp32, summed on the way) along with it: after
  cp - 1 hops a block's gradient is at its owner. Saved for the backward: this rank's q, k, v, the
  output (sequence-major, so the out-projection's input is a view of it, as with SDPA) and the
  fp32 log-sum-exp -- what plain attention saves; in flight at any time at most two blocks of
  keys/values (the one in hand, the one arriving) and, backward, two of dK/dV. Peers are global
  ranks taken from the cp group, so any cp group runs on gloo (cp × mp, cp × pp; the all-gather of
  torch.distributed.nn.functional, used once, failed there: "Global rank 0 is not part of group").
  Traffic per layer: forward cp - 1 blocks of K/V ((cp-1)/cp of the sequence's), backward the
  same again and as many of fp32 dK/dV.
- ulysses: an all-to-all turns q, k, v from sequence-sharded (all heads, 1/cp of the tokens) into
  head-sharded (1/cp of the heads, all the tokens), plain causal attention runs on whole sequences,
  and a second all-to-all turns the output back (Jacobs et al. 2023, "DeepSpeed Ulysses").

Ulysses' all-to-alls are differentiable through the experts' exchange (compat.all_to_all_autograd;
the backward another all-to-all). The ring computes in plain tensor ops (math attention): torch's
SDPA-based context_parallel does not run on a CPU.

Packed documents (data=jsonl: a row holds several documents, positions restarting at each): every
cp rank gets its chunks' positions the way it gets its tokens (`SeqShard.shard_batch`), and the
document ids of the whole row besides (`document_ids`: b·s integers, derived from the whole row's
positions before it is cut, so no rank has to ask another which document a key chunk belongs to).
A query sees a key when causality allows it AND both lie in the same document: ulysses builds
that mask over the whole sequence it holds (in sequence order; s×s booleans, as attention without
cp does: for long rows the ring's c×c per block is the smaller); the ring ANDs each (query chunk,
key chunk) pair's causal block mask with the two chunks' documents, forward and backward. A query
may then see nothing of a block (a "full" block of another document): its log-sum-exp there is
-inf and its output 0, and the merge weighs such a block by 0 instead of exp(-inf + inf) = NaN;
every query sees itself in its diagonal block, so the merged log-sum-exp is finite. A rank's
chunks hold some of the row's learned labels, not 1/cp of them (prompt and padding tokens are
skipped): `SeqShard.loss_weight` turns the rank's mean into its share of the whole mean.

The model asks for this through its attention and position modules' `seq` attribute (None: the
whole sequence is here); `apply_context_parallel` sets it. The loss of a rank is its chunks' mean,
times `loss_weight` (1 when every label is learned): the mean over the cp group (what the gradient
reduction and the logged loss average) is the whole sequence's mean.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

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


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """Which document of its row each token belongs to, [b, s] -> [b, s] (0, 1, …): packed documents
    (data/jsonl.py) start where their position is 0."""
    return (positions == 0).cumsum(-1)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp to subtract: -inf (a query that sees no key of the block) read as 0, so that the
    masked scores' exp(-inf - 0) gives the probabilities 0 (not exp(-inf + inf) = NaN)."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [.., m, d] over one block of keys/values [.., n, d], in fp32: the output
    and the log-sum-exp of each query's scores [.., m, 1]. keep: which (query, key) pairs may attend
    (`block_mask`), None: all. A query that may attend to none gets output 0 and log-sum-exp -inf."""
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - _finite(lse)) @ v.float(), lse


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' attention of the same queries, as if their keys had been one block: each output
    weighted by its share of the total softmax mass, exp(lse_block - lse_total) (0 for a block the
    query saw nothing of, also when it has seen nothing yet at all)."""
    lse = torch.logaddexp(lse_a, lse_b)
    total = _finite(lse)
    return out_a * torch.exp(lse_a - total) + out_b * torch.exp(lse_b - total), lse


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: query head i uses kv head i // (heads / kv_heads) (SDPA's enable_gqa)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def block_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """How query chunk `q_chunk` attends to key chunk `k_chunk` (global chunk indices): "skip" (the
    keys all come after the queries, causal), "diagonal" (the same positions: causal within) or
    "full"."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diagonal" if k_chunk == q_chunk else "skip"


def block_mask(
    kind: str, q_chunk: int, k_chunk: int, c: int, documents: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Which (query, key) pairs of a computed block of chunks of `c` tokens may attend: the causal
    triangle on the diagonal, AND (packed documents: `documents` [b, s], the whole row's document
    ids) the same document -- [c, c] or [b, 1, c, c], True: may attend; None: every pair."""
    keep = torch.ones(c, c, dtype=torch.bool, device=device).tril() if kind == "diagonal" else None
    if documents is None:
        return keep
    dq, dk = (documents[:, i * c : (i + 1) * c].to(device) for i in (q_chunk, k_chunk))
    same = (dq[:, :, None] == dk[:, None, :]).unsqueeze(1)
    return same if keep is None else same & keep


def ring_owners(rank: int, cp: int) -> list[int]:
    """Whose keys/values cp rank `rank` holds at each of the ring's cp steps: its own first, then
    those of the rank before it, and so on (every step each rank passes its block to the next)."""
    return [(rank - step) % cp for step in range(cp)]


def _chunk(x: torch.Tensor, half: int) -> torch.Tensor:
    """Chunk `half` (0: head, 1: tail) of a rank's two along the sequence (dim -2)."""
    c = x.shape[-2] // 2
    return x[..., half * c : (half + 1) * c, :]


def attend_block(
    q: torch.Tensor,
    kv: torch.Tensor,
    q_ids: tuple[int, int],
    k_ids: tuple[int, int],
    causal: bool,
    acc: list[tuple[torch.Tensor, torch.Tensor] | None],
    documents: torch.Tensor | None = None,
) -> None:
    """One ring step forward: this rank's query chunks q [b, h, 2c, d] over the key/value block kv
    [2, b, kv_heads, 2c, d] of the rank holding chunks `k_ids`, merged into `acc` (per query chunk:
    the fp32 output and log-sum-exp so far, None before its first block). documents: the whole
    row's document ids [b, s] (packed documents), or None."""
    c = q.shape[-2] // 2
    for a, qi in enumerate(q_ids):
        for bj, kj in enumerate(k_ids):
            kind = block_kind(qi, kj, causal)
            if kind == "skip":
                continue
            k = _expand_kv(_chunk(kv[0], bj), q.shape[1])
            v = _expand_kv(_chunk(kv[1], bj), q.shape[1])
            o, lse = block_attention(_chunk(q, a), k, v, block_mask(kind, qi, kj, c, documents, q.device))
            acc[a] = (o, lse) if acc[a] is None else merge(*acc[a], o, lse)


def block_grads(
    q: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    kv: torch.Tensor,
    q_ids: tuple[int, int],
    k_ids: tuple[int, int],
    causal: bool,
    grad_q: torch.Tensor,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """One ring step backward (FlashAttention's, block by block): the scores recomputed from q and
    the block's keys, the probabilities from the forward's log-sum-exp `lse`; adds this block's
    share of dq into `grad_q` (fp32, like q) and returns the block's dK/dV [2, b, kv_heads, 2c, d]
    (fp32) from this rank's queries. delta: rowsum(dO · O), fp32 [b, h, 2c, 1]. documents: as
    attend_block's (the forward's mask, applied again to the recomputed scores)."""
    scale = 1 / math.sqrt(q.shape[-1])
    c = q.shape[-2] // 2
    heads, kv_heads = q.shape[1], kv.shape[2]
    grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    for a, qi in enumerate(q_ids):
        qa, doa = _chunk(q, a).float(), _chunk(grad_out, a).float()
        for bj, kj in enumerate(k_ids):
            kind = block_kind(qi, kj, causal)
            if kind == "skip":
                continue
            k = _expand_kv(_chunk(kv[0], bj), heads).float()
            v = _expand_kv(_chunk(kv[1], bj), heads).float()
            scores = (qa @ k.transpose(-2, -1)) * scale
            keep = block_mask(kind, qi, kj, c, documents, q.device)
            if keep is not None:
                scores = scores.masked_fill(~keep, float("-inf"))
            p = torch.exp(scores - _finite(_chunk(lse, a)))
            dv = p.transpose(-2, -1) @ doa
            ds = p * (doa @ v.transpose(-2, -1) - _chunk(delta, a))
            _chunk(grad_q, a).add_(ds @ k, alpha=scale)
            dk = (ds.transpose(-2, -1) @ qa) * scale
            if kv_heads != heads:  # the query heads sharing a kv head sum into it
                dk, dv = (x.unflatten(1, (kv_heads, heads // kv_heads)).sum(2) for x in (dk, dv))
            _chunk(grad_kv[0], bj).add_(dk)
            _chunk(grad_kv[1], bj).add_(dv)
    return grad_kv


class _Ring:
    """Point-to-point passing around a cp group: every rank sends to the next (cp rank + 1) and
    receives from the one before, asynchronously (torch.distributed batch_isend_irecv; peers as
    global ranks, taken from the group, so any cp group works: cp × mp, cp × pp)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, cp: int):
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (rank - 1) % cp)

    def start(self, send: torch.Tensor, tag: int = 0) -> tuple[torch.Tensor, list]:
        """Send `send` on, receive its like from behind: (the receive buffer, the Works to wait for
        before reading it -- or overwriting `send`). tag: which flow (the backward has the keys/values
        and the travelling dK/dV in flight at once; gloo matches messages by tag, NCCL in order)."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(pending: tuple[torch.Tensor, list]) -> torch.Tensor:
        recv, works = pending
        for w in works:
            w.wait()
        return recv


class _RingAttention(torch.autograd.Function):
    """Ring attention with its own backward (module doc): forward cp steps over the blocks passed
    around the ring; backward the keys/values around the ring again, each block's dK/dV travelling
    with it and arriving at its owner after cp - 1 hops. Saves q, k, v (this rank's), the output
    and the fp32 log-sum-exp: nothing of the other ranks' blocks."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, rank: int, cp: int, causal: bool, documents=None):
        kv = torch.stack((k, v))
        q_ids = chunk_ids(rank, cp)
        acc: list = [None, None]
        for step, owner in enumerate(ring_owners(rank, cp)):
            pending = ring.start(kv) if step < cp - 1 else None  # the next block, while this computes
            attend_block(q, kv, q_ids, chunk_ids(owner, cp), causal, acc, documents)
            if pending is not None:
                kv = ring.finish(pending)
        out32 = torch.cat([o for o, _ in acc], dim=-2)
        lse = torch.cat([x for _, x in acc], dim=-2)
        # laid out sequence-major ([b, s, h, d] in memory), as SDPA's: the out-projection's input
        # (transpose back, flatten the heads) is then a view of it, not a copy
        b, h, s, d = out32.shape
        out = out32.new_empty((b, s, h, d), dtype=q.dtype).copy_(out32.transpose(1, 2)).transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.rank, ctx.cp, ctx.causal, ctx.documents = ring, rank, cp, causal, documents
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, rank, cp, causal = ctx.ring, ctx.rank, ctx.cp, ctx.causal
        delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        q_ids = chunk_ids(rank, cp)
        kv = torch.stack((k, v))
        own = travelling = None
        for step, owner in enumerate(ring_owners(rank, cp)):
            pending = ring.start(kv) if step < cp - 1 else None
            ids = chunk_ids(owner, cp)
            grads = block_grads(q, grad_out, lse, delta, kv, q_ids, ids, causal, grad_q, ctx.documents)
            if step == 0:
                own = grads  # this rank's share of its own block's gradient: added last, at home
            else:
                # the block's dK/dV from the ranks it visited so far (none at step 1), plus ours,
                # on to the next rank (at the last step: the block's owner)
                if travelling is not None:
                    grads = grads + ring.finish(travelling)
                travelling = ring.start(grads, tag=1)
            if pending is not None:
                kv = ring.finish(pending)
        if travelling is not None:
            own = own + ring.finish(travelling)
        return grad_q.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None, None


@dataclass
class SeqShard:
    """This rank's place in its cp group, and attention over the group's whole sequences."""

    group: dist.ProcessGroup
    rank: int
    cp: int
    method: str  # "ring" | "ulysses"
    _ring_peers: _Ring | None = field(default=None, repr=False)  # (made at the first ring attention)

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return local_positions(local_len * self.cp, self.rank, self.cp, device)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunks of a [b, s, …] batch tensor."""
        return shard_sequence(x, self.rank, self.cp, dim=1)

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's chunks of every tensor of a batch; with packed documents' `positions`, also
        `documents`: the document ids of the whole rows (module doc), which attention compares
        between any query chunk and any key chunk."""
        out = {k: self.shard(t) for k, t in batch.items()}
        if "positions" in batch:
            out["documents"] = document_ids(batch["positions"])
        return out

    def loss_weight(self, labels: torch.Tensor, mine: torch.Tensor, ignore: int = -100):
        """(labels, weight): this rank's mean loss over its labels `mine` times `weight` is its share
        of the mean over the whole batch `labels` (labels `ignore` skipped), so that the cp group's
        mean (what the gradient reduction takes) is the whole batch's: cp · learned here / learned in
        all (1 when no label is skipped). A rank with no label to learn gets weight 0 and one label
        made learnable (a mean over no label is NaN, and the rank must still run its backward's
        collectives); a tensor computation, no host synchronisation."""
        here, total = (x.ne(ignore).sum() for x in (mine, labels))
        weight = self.cp * here / total.clamp(min=1)
        mine = mine.clone()
        first = mine.view(-1)[:1]
        first.copy_(torch.where(here == 0, torch.zeros_like(first), first))
        return mine, weight

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [b, h, s_local, d], k and v [b, kv_heads, s_local, d] (this rank's chunks) -> the output
        of attention over the whole sequence for this rank's queries, [b, h, s_local, d], q's dtype.
        documents: the whole rows' document ids [b, s] (`shard_batch`): attention within documents."""
        if self.method == "ulysses":
            return self._ulysses(q, k, v, causal, documents)
        return self._ring(q, k, v, causal, documents)

    def _ring(self, q, k, v, causal: bool, documents: torch.Tensor | None) -> torch.Tensor:
        if self._ring_peers is None:
            self._ring_peers = _Ring(self.group, self.rank, self.cp)
        return _RingAttention.apply(q, k, v, self._ring_peers, self.rank, self.cp, causal, documents)

    def _ulysses(self, q, k, v, causal: bool, documents: torch.Tensor | None) -> torch.Tensor:
        order = self._natural_order(q.shape[-2], q.device)
        qs, ks, vs = (self._to_heads(x)[..., order, :] for x in (q, k, v))
        mask = None
        if documents is not None:  # q, k, v are in sequence order now: the whole rows are one block
            kind = "diagonal" if causal else "full"
            mask = block_mask(kind, 0, 0, documents.shape[-1], documents, q.device)
        out = F.scaled_dot_product_attention(
            qs,
            ks,
            vs,
            attn_mask=mask,
            is_causal=causal and mask is None,
            enable_gqa=ks.shape[1] != qs.shape[1],
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
