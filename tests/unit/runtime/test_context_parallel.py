"""Context parallelism's math without processes: head-tail chunking and the blockwise softmax merge
against plain full attention (torch's SDPA on the whole sequence)."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
import torch.nn.functional as F

from fleetwise.runtime.context_parallel import (
    SeqShard,
    _RingAttention,
    attend_block,
    block_attention,
    block_grads,
    block_kind,
    block_mask,
    chunk_ids,
    document_ids,
    local_positions,
    merge,
    ring_owners,
    shard_sequence,
)

# packed rows of 16 tokens (documents' lengths, padding a document of its own): documents crossing
# the chunk borders of cp 2 (chunks of 4) and cp 4 (chunks of 2), a one-token document, and a
# document inside one chunk at both (row 1's tokens 10-11)
ROWS = ([5, 2, 6, 3], [1, 9, 2, 4])


def packed_positions(rows=ROWS) -> torch.Tensor:
    """The positions data=jsonl gives such rows: each document counts from 0."""
    return torch.tensor([[p for n in row for p in range(n)] for row in rows])


def packed_mask(rows=ROWS) -> torch.Tensor:
    """[b, 1, s, s], True: may attend -- written out token by token from the documents' lengths."""
    s = sum(rows[0])
    mask = torch.zeros(len(rows), 1, s, s, dtype=torch.bool)
    for b, row in enumerate(rows):
        start = 0
        for n in row:
            for i in range(start, start + n):
                mask[b, 0, i, start : i + 1] = True
            start += n
    return mask


def test_head_tail_chunks_cover_the_sequence_once():
    seq, cp = 24, 3
    x = torch.arange(seq)[None]  # [b=1, s]
    got = [shard_sequence(x, r, cp)[0].tolist() for r in range(cp)]
    # rank r: chunk r and chunk 2cp-1-r, of 4 tokens each
    assert got[0] == [0, 1, 2, 3, 20, 21, 22, 23]
    assert got[1] == [4, 5, 6, 7, 16, 17, 18, 19]
    assert got[2] == [8, 9, 10, 11, 12, 13, 14, 15]
    assert sorted(sum(got, [])) == list(range(seq))
    for r in range(cp):
        assert local_positions(seq, r, cp).tolist() == got[r]
    assert chunk_ids(0, 4) == (0, 7)


def test_merge_of_two_blocks_equals_one_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    o1, l1 = block_attention(q, k[..., :2, :], v[..., :2, :])
    o2, l2 = block_attention(q, k[..., 2:, :], v[..., 2:, :])
    out, lse = merge(o1, l1, o2, l2)
    assert torch.allclose(out.double(), want, atol=1e-6)
    scores = q @ k.transpose(-2, -1) / 8**0.5
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1, keepdim=True), atol=1e-5)


def test_each_ranks_blocks_are_skipped_diagonal_or_full_as_causality_says():
    """cp 2: chunks of 4 (rank 0: 0 and 3, rank 1: 1 and 2). Per rank and ring step, the (query
    chunk, key chunk) pairs of its two query chunks over the block it holds; 2·cp + 1 = 5 computed."""
    assert ring_owners(0, 2) == [0, 1] and ring_owners(1, 2) == [1, 0] and ring_owners(1, 4) == [1, 0, 3, 2]

    def kinds(rank, cp):
        return [
            [block_kind(qi, kj, causal=True) for qi in chunk_ids(rank, cp) for kj in chunk_ids(owner, cp)]
            for owner in ring_owners(rank, cp)
        ]

    # pairs in the order (head, head), (head, tail), (tail, head), (tail, tail)
    assert kinds(0, 2) == [
        ["diagonal", "skip", "full", "diagonal"],  # its own chunks 0, 3
        ["skip", "skip", "full", "full"],  # rank 1's 1, 2: after chunk 0, before chunk 3
    ]
    assert kinds(1, 2) == [
        ["diagonal", "skip", "full", "diagonal"],  # its own chunks 1, 2
        ["full", "skip", "full", "skip"],  # rank 0's 0 (before both), 3 (after both)
    ]
    for cp in (2, 3, 4):
        for r in range(cp):
            computed = [k for step in kinds(r, cp) for k in step if k != "skip"]
            assert len(computed) == 2 * cp + 1 and computed.count("diagonal") == 2
    assert block_kind(3, 1, causal=False) == block_kind(1, 3, causal=False) == "full"


def run_virtual_ranks(rank, cp: int) -> None:
    """`rank(r)` for every cp rank at once, one thread each (their exchanges block on each other)."""
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def whole_sequence(parts: list[torch.Tensor], like: torch.Tensor, s: int, cp: int) -> torch.Tensor:
    """The cp ranks' outputs (their head-tail chunks, sequence on dim -2) put back in sequence order."""
    got = torch.empty_like(like)
    for r, part in enumerate(parts):
        got[..., local_positions(s, r, cp), :] = part
    return got


class _VirtualRing:
    """cp ranks as threads of one process, passing tensors through queues: the transport
    _RingAttention uses (`start`, `finish`), without process groups."""

    def __init__(self, cp: int):
        self.cp = cp
        self.boxes = {(r, tag): queue.Queue() for r in range(cp) for tag in (0, 1)}

    def peer(self, rank: int):
        ring = self

        class Peer:
            def start(self, send, tag=0):
                ring.boxes[((rank + 1) % ring.cp, tag)].put(send.clone())
                return rank, tag

            @staticmethod
            def finish(pending):
                return ring.boxes[pending].get(timeout=30)

        return Peer()


@pytest.mark.parametrize(
    ("cp", "heads", "kv_heads", "packed"),
    [(2, 2, 2, False), (4, 2, 2, False), (4, 4, 2, False), (2, 2, 2, True), (4, 4, 2, True)],
)
def test_ring_attention_over_virtual_ranks_equals_full_causal_attention(cp, heads, kv_heads, packed):
    """_RingAttention's forward and hand-written backward, cp ranks as threads (the ring's keys and
    values, and the dK/dV travelling back to their owners, through queues), laid back in sequence
    order: the output and the gradients of q, k and v equal SDPA's over the whole sequence (grouped-
    query attention too); packed documents (ROWS): equal SDPA's with the documents' causal mask --
    some queries see nothing of some blocks (a "full" block of earlier documents), and stay finite."""
    torch.manual_seed(0)
    b, s, d = 2, 16, 4
    q = torch.randn(b, heads, s, d, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, s, d, requires_grad=True) for _ in range(2))
    gqa = heads != kv_heads
    if packed:
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=packed_mask(), enable_gqa=gqa)
    else:
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    documents = document_ids(packed_positions()) if packed else None
    if packed:  # what the merge must survive: the last query sees nothing of chunk 0 (a full block)
        assert not block_mask("full", 2 * cp - 1, 0, s // (2 * cp), documents, q.device)[0, 0, -1].any()
    w = torch.randn_like(want)
    grads_want = torch.autograd.grad((want * w).sum(), (q, k, v))

    ring = _VirtualRing(cp)
    results: dict[int, tuple] = {}

    def rank(r):
        mine = [shard_sequence(x.detach(), r, cp, dim=2).requires_grad_() for x in (q, k, v)]
        out = _RingAttention.apply(*mine, ring.peer(r), r, cp, True, documents)
        grads = torch.autograd.grad((out * shard_sequence(w, r, cp, dim=2)).sum(), mine)
        results[r] = (out.detach(), *grads)

    run_virtual_ranks(rank, cp)
    assert sorted(results) == list(range(cp))
    # sequence-major like SDPA's output: the out-projection's input is a view of it
    assert results[0][0].transpose(1, 2).is_contiguous()
    for i, full in enumerate((want, *grads_want)):
        got = whole_sequence([results[r][i] for r in range(cp)], full, s, cp)
        assert torch.isfinite(got).all() and torch.allclose(got, full, atol=1e-5), i


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_every_ranks_blocks_merge_like_full_causal_attention(cp):
    """The ring's steps as pure functions, no transport: each rank's query chunks over every rank's
    key/value block (attend_block, log-sum-exp merge), laid back in sequence order, equal causal
    attention over the sequence; and the blockwise backward (block_grads: dq summed on the rank,
    each block's dK/dV summed over the ranks that saw it) equals autograd's gradients of it."""
    torch.manual_seed(0)
    b, h, s, d = 2, 2, 16, 4
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    w = torch.randn_like(want)
    grads_want = torch.autograd.grad((want * w).sum(), (q, k, v))
    with torch.no_grad():
        kv = [torch.stack([shard_sequence(x, r, cp, dim=2) for x in (k, v)]) for r in range(cp)]
        got, dq, dkv = torch.empty_like(want), torch.empty_like(q), [torch.zeros_like(x) for x in kv]
        for r in range(cp):
            mine, acc = shard_sequence(q, r, cp, dim=2), [None, None]
            for owner in ring_owners(r, cp):
                attend_block(mine, kv[owner], chunk_ids(r, cp), chunk_ids(owner, cp), True, acc)
            out, lse = (torch.cat([a[i] for a in acc], dim=-2) for i in (0, 1))
            got[..., local_positions(s, r, cp), :] = out
            g = shard_sequence(w, r, cp, dim=2)
            delta, grad_q = (g * out).sum(-1, keepdim=True), torch.zeros_like(mine)
            for owner in ring_owners(r, cp):
                ids = chunk_ids(owner, cp)
                dkv[owner] += block_grads(mine, g, lse, delta, kv[owner], chunk_ids(r, cp), ids, True, grad_q)
            dq[..., local_positions(s, r, cp), :] = grad_q
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(dq, grads_want[0], atol=1e-5)
    for i in (1, 2):
        full = torch.empty_like(k)
        for r in range(cp):
            full[..., local_positions(s, r, cp), :] = dkv[r][i - 1]
        assert torch.allclose(full, grads_want[i], atol=1e-5)


class _VirtualUlysses(SeqShard):
    """A SeqShard whose all-to-all runs between threads through queues (boxes[(src, dst)])."""

    boxes: dict

    def _all_to_all(self, send):
        for i in range(self.cp):
            self.boxes[(self.rank, i)].put(send[i].clone())
        return torch.stack([self.boxes[(j, self.rank)].get(timeout=30) for j in range(self.cp)])


@pytest.mark.parametrize(("cp", "heads", "kv_heads"), [(2, 4, 2), (4, 4, 4)])
def test_ulysses_over_virtual_ranks_masks_packed_documents_in_sequence_order(cp, heads, kv_heads):
    """Ulysses with packed documents, cp ranks as threads: each rank's batch (shard_batch: its
    chunks' positions, the whole rows' document ids), its heads of the whole sequence after the
    all-to-all, the documents' mask in sequence order, and back: the output equals SDPA's over the
    whole sequence with the documents' causal mask."""
    torch.manual_seed(0)
    b, s, d = 2, 16, 4
    q = torch.randn(b, heads, s, d)
    k, v = (torch.randn(b, kv_heads, s, d) for _ in range(2))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=packed_mask(), enable_gqa=heads != kv_heads)
    boxes = {(i, j): queue.Queue() for i in range(cp) for j in range(cp)}
    results: dict[int, torch.Tensor] = {}

    def rank(r):
        shard = _VirtualUlysses(None, r, cp, "ulysses")
        shard.boxes = boxes
        batch = shard.shard_batch({"positions": packed_positions(), "tokens": torch.arange(s).expand(b, s)})
        assert batch["tokens"][0].tolist() == local_positions(s, r, cp).tolist()
        assert batch["positions"].tolist() == shard.shard(packed_positions()).tolist()
        mine = [shard.shard(x.transpose(1, 2)).transpose(1, 2) for x in (q, k, v)]
        results[r] = shard.attend(*mine, causal=True, documents=batch["documents"])

    run_virtual_ranks(rank, cp)
    assert sorted(results) == list(range(cp))
    got = whole_sequence([results[r] for r in range(cp)], want, s, cp)
    assert torch.allclose(got, want, atol=1e-5)


def test_loss_weights_make_the_cp_groups_mean_the_whole_batchs_mean():
    """Packed rows learn some labels only (prompts and padding are -100): each cp rank's mean over
    its chunks, weighted by loss_weight, averages over the group to the whole batch's mean -- a
    rank with nothing to learn included (weight 0, finite loss, not a mean over no label)."""
    torch.manual_seed(0)
    cp, b, s, vocab = 4, 2, 16, 7
    labels = torch.randint(0, vocab, (b, s))
    labels[:, 2:4] = labels[:, 12:14] = -100  # rank 1's chunks (2-3 and 12-13 at cp 4): nothing to learn
    labels[0, 6:9] = -100
    logits = torch.randn(b, s, vocab)
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    shares = []
    for r in range(cp):
        shard = SeqShard(None, r, cp, "ring")
        mine, weight = shard.loss_weight(labels, shard.shard(labels))
        loss = F.cross_entropy(shard.shard(logits).flatten(0, 1), mine.flatten(), ignore_index=-100) * weight
        assert torch.isfinite(loss), r
        shares.append(loss)
        if r == 1:
            assert weight.item() == 0.0
    assert torch.allclose(torch.stack(shares).mean(), want, atol=1e-6)
    # nothing skipped: every weight exactly 1 (the synthetic data's runs unchanged)
    full = torch.randint(0, vocab, (b, s))
    for r in range(cp):
        shard = SeqShard(None, r, cp, "ring")
        assert shard.loss_weight(full, shard.shard(full))[1].item() == 1.0
