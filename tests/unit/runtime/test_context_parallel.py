"""Context parallelism's math without processes: head-tail chunking and the blockwise softmax merge
against plain full attention (torch's SDPA on the whole sequence)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fleetwise.runtime.context_parallel import (
    block_attention,
    chunk_ids,
    chunked_attention,
    local_positions,
    merge,
    shard_sequence,
)


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
    o1, l1 = block_attention(q, k[..., :2, :], v[..., :2, :], causal_diagonal=False)
    o2, l2 = block_attention(q, k[..., 2:, :], v[..., 2:, :], causal_diagonal=False)
    out, lse = merge(o1, l1, o2, l2)
    assert torch.allclose(out.double(), want, atol=1e-6)
    scores = q @ k.transpose(-2, -1) / 8**0.5
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1, keepdim=True), atol=1e-5)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_every_ranks_chunks_attend_like_full_causal_attention(cp):
    """Each rank's query chunks over the whole sequence's key chunks (what ring attention computes
    once the keys arrived), laid back in sequence order, equal causal attention over the sequence;
    and the gradients of q, k, v too."""
    torch.manual_seed(0)
    b, h, s, d = 2, 2, 16, 4
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    c = s // (2 * cp)
    k_chunks = {i: k[..., i * c : (i + 1) * c, :] for i in range(2 * cp)}
    v_chunks = {i: v[..., i * c : (i + 1) * c, :] for i in range(2 * cp)}
    got = torch.empty_like(want)
    for r in range(cp):
        ids = chunk_ids(r, cp)
        mine = chunked_attention(
            [q[..., i * c : (i + 1) * c, :] for i in ids], ids, k_chunks, v_chunks, causal=True
        )
        got[..., local_positions(s, r, cp), :] = mine
    assert torch.allclose(got, want, atol=1e-6)
    w = torch.randn_like(want)
    grads_want = torch.autograd.grad((want * w).sum(), (q, k, v))
    grads_got = torch.autograd.grad((got * w).sum(), (q, k, v))
    for a, g in zip(grads_want, grads_got, strict=True):
        assert torch.allclose(a, g, atol=1e-5)
