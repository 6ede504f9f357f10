"""Context parallelism in the plan: what a cp rank saves and sends beyond its 1/cp of the tokens.

Each cp rank holds 2 chunks of c = seq_len / (2·cp) tokens of every sequence, so every activation
the units count per token (plan/units.py) is 1/cp of one rank's (plan/memory/context.py divides).
What attention over the whole sequence adds, per layer and sample, as runtime/context_parallel.py
computes it:

- ring: nothing beyond what plain attention saves (this rank's q, k, v, the output laid out
  sequence-major as SDPA's, the log-sum-exp: the units count them): the ring's backward is written
  by hand and recomputes each block's probabilities, so autograd keeps none of the other ranks'
  keys/values nor any block's scores. What it holds only while it runs (`ring_backward_peak`, the
  block's backward peak): per sample two blocks of K/V (the one in hand and the one arriving;
  one at cp 2, where the last step receives nothing) and the fp32 dK/dV -- this rank's own share,
  the one in flight out and in, the one being computed (three at cp 2, where the first step sends
  none) -- beside dq (fp32), rowsum(dO·O), and one c×c block's probabilities and their gradients
  (packed documents, data=jsonl: and the block's c×c boolean masks, same-document and its AND with
  the causal triangle, shared by the heads; the rows' document ids, 8 bytes a token per micro-batch
  for all the layers, are not counted).
  Under tensor parallelism every count is of the mp rank's heads (1/mp of them).
  Traffic per layer and micro-batch, as cp - 1 point-to-point steps each way: forward (cp-1)/cp
  of the sequence's K/V; backward the same K/V again and as much dK/dV in fp32 (`ring_steps`).
- ulysses: attention saves the head-sharded q, k, v in sequence order instead of the local ones (the
  same sizes: already counted), and its output apart from the output's all-to-all copy back that
  the out-projection saves (one is a view of the other without cp): heads·d·S/cp more;
  packed documents: its attention's boolean mask is the whole rows' s×s, as plain attention's is
  without cp (families/llama/model.py document_mask) -- counted in neither;
  traffic: four all-to-alls (q, k, v, output) of (cp-1)/cp of the local tensors forward, four back.

FLOPs (as the dry run counts them): a cp rank computes 1/cp of every token's dense work; ulysses'
attention is the fused kernel's over 1/cp of the heads; the ring's is plain matmuls over the
2·cp + 1 blocks of c×c a rank's two chunks see, of the (2·cp)² a full sequence's scores have:
forward 2 (QKᵀ, PV), backward 5 (QKᵀ again, dV, dP, dQ, dK), 3.5 times the forward.

Overlap (`ring_hidden_seconds`): each ring step's transfer starts before the step's blocks are
computed and is waited for after them, so per step min(transfer, compute) hides: forward the next
K/V block behind this step's blocks (3 at the first step, 2 after: 2·cp + 1 in all); backward the
next K/V block and the dK/dV sent at the step before behind this step's (2.5 times the forward's
work); the last dK/dV hop, home, has nothing to hide behind. Transfer: the profile's cp bandwidth
and latency; compute: the blocks' GEMMs at the profile's peak and GEMM efficiency. On a CPU the
same cores move and compute: nothing hides (as for the other dimensions, plan/time.py). Ulysses'
all-to-alls sit between the projections and attention: exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.plan.dtypes import FP32
from fleetwise.plan.units import Unit


@dataclass(frozen=True)
class AttentionShape:
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int

    @classmethod
    def of(cls, cfg: RunConfig, mp: int = 1) -> AttentionShape:
        """mp: tensor parallelism's degree -- each mp rank attends with its 1/mp of the heads (and of
        the kv heads), so a cp rank's ring or all-to-alls carry those only."""
        m = cfg.model
        heads = m.num_attention_heads
        head_dim = getattr(m, "head_width", None) or m.hidden_size // heads
        kv = getattr(m, "num_kv_heads", None) or heads
        if mp > 1:
            heads, kv = heads // mp, max(1, kv // mp)
        return cls(m.seq_len, heads, kv, head_dim, m.num_layers)


def saved_per_layer(cfg: RunConfig, layout: Layout, act_bytes: float) -> float:
    """Bytes per sample one block saves for its backward beyond its tokens' share (the module doc)."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    a = AttentionShape.of(cfg, layout.mp)
    if cfg.strategy.cp_method == "ulysses":
        return a.heads * a.head_dim * a.seq / cp * act_bytes
    return 0.0  # the ring: what plain attention saves (the module doc)


def ring_backward_peak(cfg: RunConfig, layout: Layout, act_bytes: float) -> float:
    """Bytes per sample the ring's backward holds while it runs (the module doc); 0 without it."""
    cp = layout.cp
    if cp == 1 or cfg.strategy.cp_method != "ring":
        return 0.0
    a = AttentionShape.of(cfg, layout.mp)
    local = a.seq / cp
    c = local / 2
    block = 2 * local * a.kv_heads * a.head_dim  # one rank's k and v
    blocks = block * (act_bytes + 3 * FP32) if cp == 2 else block * (2 * act_bytes + 4 * FP32)
    dq = a.heads * local * (a.head_dim + 1) * FP32  # and rowsum(dO·O)
    pair = 3 * a.heads * c * c * FP32  # one block's probabilities, dP, dS
    if cfg.data.source == "jsonl":  # packed documents: the block's masks (bool), shared by the heads
        pair += 2 * c * c
    if act_bytes != FP32 or a.kv_heads != a.heads:  # the pair's q, dO, k, v in fp32 at the query heads
        pair += 4 * a.heads * c * a.head_dim * FP32
    return blocks + dq + pair


def ring_steps(cfg: RunConfig, layout: Layout, act_bytes: float) -> tuple[float, float]:
    """Bytes one ring step sends per sample: a block of K/V, a block of dK/dV (fp32)."""
    a = AttentionShape.of(cfg, layout.mp)
    block = 2 * a.seq / layout.cp * a.kv_heads * a.head_dim
    return block * act_bytes, block * FP32


def traffic_per_layer(cfg: RunConfig, layout: Layout, act_bytes: float) -> tuple[float, float, int, int]:
    """Bytes one device sends per layer and micro-batch sample, forward and backward, and its calls
    (sends) per micro-batch, forward and backward."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0, 0, 0
    share = (cp - 1) / cp
    if cfg.strategy.cp_method == "ulysses":
        a = AttentionShape.of(cfg, layout.mp)
        local = (2 * a.heads + 2 * a.kv_heads) * a.head_dim * a.seq / cp * act_bytes
        return share * local, share * local, 4, 4
    kv, grads = ring_steps(cfg, layout, act_bytes)
    return (cp - 1) * kv, (cp - 1) * (kv + grads), cp - 1, 2 * (cp - 1)


def cp_traffic(cfg: RunConfig, layout: Layout, n: int, recomputes: int = 0) -> tuple[float, int]:
    """One device's cp traffic per step: every layer, micro-batch and sample (a full recompute runs
    the forward's traffic again: `recomputes` layers)."""
    fwd, bwd, fwd_calls, bwd_calls = traffic_per_layer(cfg, layout, _act_bytes(cfg))
    layers = AttentionShape.of(cfg).layers
    b = cfg.train.micro_batch_size
    per_layer = (fwd + bwd) * layers + fwd * recomputes
    return n * b * per_layer, int(n * ((fwd_calls + bwd_calls) * layers + fwd_calls * recomputes))


def ring_hidden_seconds(
    cfg: RunConfig, layout: Layout, n: int, bandwidth: float, latency: float, recomputes: int = 0
) -> float:
    """Seconds of the ring's transfers per step hidden behind its blocks' attention (the module
    doc): every layer and micro-batch (and a full recompute's forwards again: `recomputes` layers);
    0 for ulysses, without cp, or on a CPU. bandwidth, latency: the cp dimension's (plan/comm.py)."""
    hw = cfg.hardware
    if layout.cp == 1 or cfg.strategy.cp_method != "ring" or hw.device_type != "cuda":
        return 0.0
    cp, b = layout.cp, cfg.train.micro_batch_size
    a = AttentionShape.of(cfg, layout.mp)
    c = a.seq / (2 * cp)
    matmul = 2 * b * a.heads * c * c * a.head_dim  # one of a block's matmuls, one micro-batch
    pair = 2 * matmul / (hw.peak_flops(cfg.train.precision) * hw.gemm_fraction(matmul))
    kv, grads = (b * x / bandwidth + latency for x in ring_steps(cfg, layout, _act_bytes(cfg)))
    computes = [3 * pair] + [2 * pair] * (cp - 1)  # the blocks of each step
    forward = sum(min(kv, t) for t in computes[:-1])
    # backward step t: the next K/V (t < cp-1) and the dK/dV sent at step t-1 (t > 1) in flight
    backward = sum(min(kv * (t < cp - 1) + grads * (t > 1), 2.5 * computes[t]) for t in range(cp))
    layers = AttentionShape.of(cfg).layers
    return n * (forward * (layers + recomputes) + backward * layers)


def _act_bytes(cfg: RunConfig) -> float:
    return FP32 if cfg.train.precision == "fp32" else 2.0


def device_flops_per_sample(cfg: RunConfig, layout: Layout, u: Unit, whole: float, reruns: int) -> float:
    """One cp rank's FLOPs per sample through unit `u`, from `whole`: the same unit's on one rank
    (plan/time.py device_flops_per_sample, flash attention counted 3.5 times its forward) and
    `reruns`, the forwards a full recompute adds to the block's backward."""
    cp = layout.cp
    if cp == 1 or cfg.strategy.cp_method == "ulysses" or not u.attn_flops:
        return whole / cp
    attention = u.attn_flops * (3.5 + reruns)
    blocks = (2 * cp + 1) / (2 * cp) ** 2  # of the whole sequence's score blocks, on one rank
    return (whole - attention) / cp + u.attn_flops * blocks * (3.5 + reruns)
