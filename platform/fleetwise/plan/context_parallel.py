"""Context parallelism in the plan: what a cp rank saves and sends beyond its 1/cp of the tokens.

Each cp rank holds 2 chunks of c = seq_len / (2·cp) tokens of every sequence, so every activation
the units count per token (plan/units.py) is 1/cp of one rank's (plan/memory/context.py divides).
What attention over the whole sequence adds, per layer and sample, as runtime/context_parallel.py
computes it:

- ring: the all-gathered keys and values of the whole sequence (2·S·kv_heads·d), saved by the block
  matmuls that read them; under grouped-query attention their copies at the query heads' count
  (2·S·heads·d); per block a query chunk attends to (a causal rank: 2·cp + 1 blocks of c×c),
  the fp32 scores and probabilities (log-sum-exp and exp each save one); and the fp32 block
  outputs the log-sum-exp merge saves (4·cp - 2 of c×d per head).
  Under tensor parallelism every count is of the mp rank's heads (1/mp of them).
  Traffic per layer and micro-batch: the all-gather of (cp-1)/cp of the whole K/V forward, and
  its backward (an all-to-all of the same bytes, summed: runtime/context_parallel.py _GatherKV).
- ulysses: attention saves the head-sharded q, k, v in sequence order instead of the local ones (the
  same sizes: already counted), and its output apart from the output's all-to-all copy back that
  the out-projection saves (one is a view of the other without cp): heads·d·S/cp more;
  traffic: four all-to-alls (q, k, v, output) of (cp-1)/cp of the local tensors forward, four back.

FLOPs (as the dry run counts them): a cp rank computes 1/cp of every token's dense work; ulysses'
attention is the fused kernel's over 1/cp of the heads; the ring's is plain matmuls (forward once,
backward twice) over the 2·cp + 1 blocks of c×c a rank's two chunks see, of the (2·cp)² a full
sequence's scores have.

Nothing here overlaps with compute (the all-gather runs before the layer's attention): the time
model counts it exposed.
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
    c = a.seq / (2 * cp)
    kv = 2 * a.seq * a.kv_heads * a.head_dim * act_bytes
    expanded = 2 * a.seq * a.heads * a.head_dim * act_bytes if a.kv_heads != a.heads else 0.0
    scores = 2 * a.heads * (2 * cp + 1) * c * c * FP32
    # the blockwise merge saves both outputs it weighs: every block's output but that of a chunk
    # seeing one block, and every merged output but the last -- 2k - 2 of [heads, c, d] fp32 for a
    # chunk over k > 1 blocks, 4·cp - 2 for any rank's two chunks (r + 1 and 2·cp - r blocks)
    merged = (4 * cp - 2) * a.heads * c * a.head_dim * FP32
    return kv + expanded + scores + merged


def traffic_per_layer(cfg: RunConfig, layout: Layout, act_bytes: float) -> tuple[float, int]:
    """Bytes one device sends, and collective calls, per layer and micro-batch sample (bytes) or
    micro-batch (calls), forward and backward."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0
    a = AttentionShape.of(cfg, layout.mp)
    share = (cp - 1) / cp
    if cfg.strategy.cp_method == "ulysses":
        local = (2 * a.heads + 2 * a.kv_heads) * a.head_dim * a.seq / cp * act_bytes
        return 2 * share * local, 8
    return 2 * share * 2 * a.seq * a.kv_heads * a.head_dim * act_bytes, 2


def cp_traffic(cfg: RunConfig, layout: Layout, n: int, recomputes: int = 0) -> tuple[float, int]:
    """One device's cp traffic per step: every layer, micro-batch and sample (a full recompute runs
    the forward's collectives again: `recomputes` layers)."""
    per_layer, calls = traffic_per_layer(cfg, layout, _act_bytes(cfg))
    layers = AttentionShape.of(cfg).layers
    b = cfg.train.micro_batch_size
    again = 0.5 * recomputes  # the forward half of the layer's traffic
    return n * b * per_layer * (layers + again), int(n * calls * (layers + again))


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
    return (whole - attention) / cp + u.attn_flops * blocks * (3 + reruns)
