"""Context parallelism in the plan (plan/context_parallel.py, plan/memory, plan/comm) against numbers
worked out by hand for gpt/tiny: seq 32, hidden 64, 4 heads of 16, 4 layers, fp32, micro-batch 2,
global batch 16."""

from __future__ import annotations

import pytest
from helpers.config import compose

from fleetwise.plan import make_plan

TINY = ("recipe=gpt/tiny", "optim=sgd")
LAYERS, B, SEQ, HEADS, D = 4, 2, 32, 4, 16


def plan_of(*overrides):
    cfg, problems = compose(*TINY, *overrides)
    assert problems == [], problems
    return make_plan(cfg)


def test_ring_and_ulysses_save_and_send_what_their_attention_does():
    cp = ("strategy=hybrid", "strategy.cp_degree=2", "hardware.devices_per_node=2")
    ring = plan_of(*cp)
    ulysses = plan_of(*cp, "strategy.cp_method=ulysses")
    # per layer and sample, fp32. ring: nothing beyond plain attention's q, k, v, output and
    # log-sum-exp (its backward is hand-written: no other rank's K/V nor any block's scores saved);
    # ulysses: attention's output (head-sharded, whole sequence) beside its all-to-all copy back
    # (without cp the out-projection saves a view of it); q, k, v saved as before, head-sharded
    ulysses_extra = HEADS * D * SEQ // 2 * 4
    assert ulysses_extra == 4_096
    # the ring's backward peak per sample (a block's while it runs), chunks of c = 32/4 = 8 tokens,
    # a rank's 16: one block of K/V in hand (at cp 2 the last step receives none: 2·16·4·16 fp32),
    # three of fp32 dK/dV (its own share, the one it sends, the one it receives), dq and
    # rowsum(dO·O) (4 heads × 16 × (16 + 1) fp32), and one 8×8 block's P, dP, dS per head
    ring_peak = 4 * 2 * 16 * HEADS * D * 4 + HEADS * 16 * (D + 1) * 4 + 3 * HEADS * 8 * 8 * 4
    assert ring_peak == 40_192
    # the block's backward peak without the ring: fc2's input gradient, 16 tokens × ffn 256, fp32
    mlp_peak = 16 * 256 * 4
    assert (
        ring.memory_bytes["activations"] - ulysses.memory_bytes["activations"]
        == B * (ring_peak - mlp_peak) - LAYERS * B * ulysses_extra
    )
    # traffic per step: 8 micro-batches per rank (16 samples / micro-batch 2, cp ranks read the
    # same samples); ring: one step each way (cp - 1), a rank's K/V block (2·16·h·4 bytes) forward,
    # the K/V block again and the fp32 dK/dV block backward
    n = 8
    ddp = ring.params * 4
    assert (
        ring.comm_bytes_per_step["cp"]
        == n * B * LAYERS * 3 * (2 * 16 * HEADS * D * 4) + ddp
        == 1_572_864 + ddp
    )
    # ulysses: q, k, v and the output (local: 16 tokens), half of each to the other rank, both ways
    assert ulysses.comm_bytes_per_step["cp"] == n * B * LAYERS * 2 * (4 * HEADS * D * 16 * 4) // 2 + ddp
    assert ring.mesh == {"pp": 1, "dp": 1, "sharding": 1, "mp": 1, "cp": 2}
    # DDP all-reduces the gradients over the cp group (dp is 1: the same group, counted as cp, as
    # the dry run sees it): 2(n-1)/n of the fp32 gradients
    assert ring.comm_bytes_per_step["dp"] == 0
    with_dp = plan_of(*cp, "hardware.devices_per_node=4")
    assert with_dp.comm_bytes_per_step["dp"] == with_dp.params * 4 * 2 * 3 / 4  # over dp × cp = 4
    assert with_dp.comm_bytes_per_step["cp"] == 1_572_864 // 2  # half the micro-batches per rank


def test_cp_divides_the_tokens_and_fsdp_shards_over_sharding_times_cp():
    one = plan_of("hardware.devices_per_node=1")
    cp2 = ("strategy=hybrid", "strategy.cp_degree=2", "hardware.devices_per_node=2")
    ring, ulysses = plan_of(*cp2), plan_of(*cp2, "strategy.cp_method=ulysses")
    assert "cp" not in one.mesh and "cp" not in one.comm_bytes_per_step
    assert ring.flops_per_step == one.flops_per_step  # the model's FLOPs: the job's, not a rank's
    # ulysses: each rank half of every sample's work (the same 8 micro-batches per rank as one
    # process), attention included (the fused kernel on half of the heads)
    one_pd, ring_pd, ulysses_pd = (p.stages[0]["flops_per_device"] for p in (one, ring, ulysses))
    assert abs(ulysses_pd * 2 / one_pd - 1) < 1e-9
    # ring: its attention is plain matmuls over 5 of the 16 score blocks of c×c, forward 2 (QKᵀ,
    # PV) and backward 5 (QKᵀ again, dV, dP, dQ, dK): 3.5x the forward, as flash's; attention's
    # forward per layer and sample 4·s²·h (QKᵀ and PV, full)
    attn = 4 * SEQ * SEQ * 64
    n = 8
    ring_attention, ulysses_attention = attn * 3.5 * 5 / 16, attn * 3.5 / 2
    assert ring_pd - ulysses_pd == pytest.approx(
        n * B * LAYERS * (ring_attention - ulysses_attention), rel=1e-9
    )
    fsdp = plan_of(
        "strategy=hybrid",
        "strategy.cp_degree=2",
        "strategy.sharding_degree=2",
        "strategy.sharding_stage=3",
        "hardware.devices_per_node=4",
    )
    assert fsdp.stages[0]["params_per_device"] == fsdp.params // 4
    # sharding_degree 1 with a stage: FSDP over cp alone (the runtime's engine and mesh agree)
    from fleetwise.config.engine import dp_engine
    from fleetwise.config.layout import Layout

    cfg, problems = compose(*TINY, *cp2, "strategy.sharding_stage=3")
    assert problems == [], problems
    assert dp_engine(Layout.of(cfg), 3) == "fsdp" and Layout.of(cfg).fsdp_dims == ("sharding_cp",)
    over_cp = make_plan(cfg)
    assert over_cp.engine == "fsdp" and over_cp.stages[0]["params_per_device"] == over_cp.params // 2
    assert over_cp.memory_bytes["optimizer"] == ring.memory_bytes["optimizer"] / 2


def test_the_plan_header_multiplies_to_the_world_size_with_cp():
    """The mesh line is the world-size rule written out: with cp it names cp (it read
    "pp 1 × dp 1 × sharding 2 × mp 1 = 4 ranks" for a 4-rank cp 2 layout); without, as it always was."""
    from fleetwise.plan.render import mesh_text

    cfg, _ = compose(*TINY, "strategy=hybrid", "strategy.cp_degree=2", "hardware.devices_per_node=4")
    plan = make_plan(cfg)
    assert mesh_text(plan.mesh) == "pp 1 × dp 2 × sharding 1 × cp 2 × mp 1"
    assert (
        mesh_text(plan_of("strategy=dp", "hardware.devices_per_node=4").mesh)
        == "pp 1 × dp 4 × sharding 1 × mp 1"
    )


def test_under_tensor_parallelism_cp_carries_the_mp_ranks_heads_and_mp_the_cp_ranks_tokens():
    """cp 2 × mp 2: the ring passes the K/V of each mp rank's 2 heads, half of cp 2's;
    the blocks' tensor-parallel collectives carry a cp rank's 16 tokens, half of mp 2's (the
    dry run's numbers for cp 2 × mp 2 sequence parallel: cp bytes equal, memory -1.3%)."""
    cp, mp = ("strategy=hybrid", "strategy.cp_degree=2"), ("strategy.mp_degree=2",)
    alone = plan_of(*cp, "hardware.devices_per_node=2")
    both = plan_of(*cp, *mp, "hardware.devices_per_node=4")
    ddp = alone.params * 4  # cp 2 alone: DDP's all-reduce over cp is in its cp entry
    assert both.comm_bytes_per_step["cp"] == (alone.comm_bytes_per_step["cp"] - ddp) / 2 == 786_432
    tp = plan_of("strategy=hybrid", *mp, "strategy.dp_degree=1", "hardware.devices_per_node=2")
    # mp 2 (no sequence parallelism): per micro-batch, each block's two (b, s, h) all-reduces
    # forward (fp32) and two backward, ½ of each sent; the embedding's output and the head's input
    # gradient one each: n·(layers·2·2·½·8 + 2·2·½·4)·b·s·h bytes -- s 32 alone, 16 a cp rank's
    n = 8
    whole = n * (LAYERS * 2 * 2 * 0.5 * 8 + 2 * 2 * 0.5 * 4) * B * SEQ * 64
    assert tp.comm_bytes_per_step["mp"] == whole == 2 * both.comm_bytes_per_step["mp"] == 2_359_296


def test_the_ring_hides_its_steps_behind_its_blocks_on_a_gpu():
    """h100 (bf16 989.4 TFLOP/s, GEMMs at 0.5 of it, 450 GB/s and 10 µs a call within the node), cp 2
    ring, seq 4096: chunks of c = 1024 tokens, a rank's 2048. One block's matmul per micro-batch:
    2·b·heads·c²·d FLOPs; a step's transfer: a rank's K/V block, 2·2048·4·16 bf16 per sample."""
    ring = plan_of(
        "strategy=hybrid",
        "strategy.cp_degree=2",
        "hardware=h100",
        "hardware.devices_per_node=2",
        "hardware.gemm_efficiency=null",
        "model.seq_len=4096",
        "train.precision=bf16",
    )
    c, n = 1024, 8
    pair = 2 * (2 * B * HEADS * c * c * D) / (989.4e12 * 0.5)  # QKᵀ and PV of one c×c block
    kv = B * 2 * 2048 * HEADS * D * 2 / 450e9 + 10e-6
    assert kv > 3 * 2.5 * pair  # latency-bound: every step's transfer is longer than its blocks
    # forward: the one transfer (for step 1) behind step 0's 3 blocks; backward: the K/V again
    # behind step 0's (2.5x the forward's work); the dK/dV sent at step 1 goes home after the last
    # blocks, exposed
    per_layer = min(kv, 3 * pair) + min(kv, 2.5 * 3 * pair)
    hidden = n * LAYERS * per_layer
    assert ring.time_s["comm_hidden"] == pytest.approx(hidden, rel=1e-9)  # dp and sharding: none
    assert ring.time_s["comm_cp"] > hidden
    # on a CPU the same cores move and compute: nothing hides
    cpu = plan_of("strategy=hybrid", "strategy.cp_degree=2", "hardware.devices_per_node=2")
    assert cpu.time_s["comm_hidden"] == 0.0 and cpu.time_s["comm_cp"] > 0


def test_the_ring_backward_peak_at_cp_4():
    """cp 4 (gpt/tiny, fp32): chunks of 4 tokens, a rank's 8. In the middle steps two K/V blocks
    (in hand, arriving) and four fp32 dK/dV (own share, the one sent, the one received, the one
    being computed), dq and rowsum(dO·O), one 4×4 block's P, dP, dS per head."""
    from fleetwise.config.layout import Layout
    from fleetwise.plan.context_parallel import ring_backward_peak

    cfg, problems = compose(*TINY, "strategy=hybrid", "strategy.cp_degree=4", "hardware.devices_per_node=4")
    assert problems == [], problems
    block = 2 * 8 * HEADS * D
    want = block * (2 * 4 + 4 * 4) + HEADS * 8 * (D + 1) * 4 + 3 * HEADS * 4 * 4 * 4
    assert ring_backward_peak(cfg, Layout.of(cfg), 4.0) == want == 27_520
    # packed documents (data=jsonl): the block's two 4×4 boolean masks (same document; AND causal)
    packed = cfg.model_copy(update={"data": cfg.data.model_copy(update={"source": "jsonl"})})
    assert ring_backward_peak(packed, Layout.of(packed), 4.0) == want + 2 * 4 * 4


def test_a_large_untied_root_with_few_tokens_peaks_at_its_reduce_scatter_input():
    """Llama 3 8B (vocabulary 128,256, hidden 4,096, embedding and head untied) at seq 8k over cp 4 ×
    ZeRO-3 sharding 2 with offload: 2,048 tokens a rank hold little, and the step peaks when FSDP
    allocates the root's fp32 reduce-scatter input while the root's bf16 gradients (embedding's
    and head's) wait to be copied in. The dry run's peak there: 6,304,358,416 B (4 layers or 32),
    of which this buffer 4,202,708,992 B; planned 5.88 GB (-6.75%) before this moment was counted."""
    cfg, problems = compose(
        "recipe=llama/llama3_8b_128k",
        "model.num_layers=4",
        "model.seq_len=8192",
        "strategy.cp_degree=4",
        "strategy.sharding_degree=2",
        "hardware.devices_per_node=8",
        "train.global_batch_size=4",
    )
    assert problems == [], problems
    plan = make_plan(cfg)
    root = 2 * 128_256 * 4_096 + 4_096  # embedding, head, final norm
    assert 4 * root == 4_202_708_992  # the dry run's buffer
    assert plan.memory_peak["phase"] == "root reduce-scatter input"
    # the fp32 buffer and the bf16 gradients; the parameters, their gradients and AdamW's state
    # are on the host (offload); the micro-batch's token ids
    assert plan.memory_peak["parts"] == {"activations": 4 * root + 2 * root, "inputs": 131_072}
    assert abs(plan.memory_bytes["total"] / 6_304_358_416 - 1) < 0.001
