"""Sampling: a job's step simulated at two small counts -- of micro-batches, and of alike blocks
per pipeline chunk -- and every count taken as affine in between (the sections below say where that
is exact and how it was held against the run of every micro-batch and block).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fleetwise.dryrun import patches

# ------------------------------------------------------------------------------------------------
# Micro-batch sampling. A step repeats the same micro-batch work n times; a job of 192 micro-batches
# is simulated with two small counts na < nb instead (three steps: nb, na, nb; where that
# runs fewer micro-batches than the job's own steps, `cheaper`), and every per-step
# count of the last two is taken as affine in the count: X(n) = X(na) + (n - na) (X(nb) - X(na)) /
# (nb - na). That is exact for FLOPs and bytes (each micro-batch's work is the same; what happens
# once per step -- FSDP's all-reduce on the last micro-batch, the optimizer -- is in both). It is
# exact for the memory peak when na already holds the steady state, so that only what is held for
# the whole step per micro-batch (the step's input batch, pipelining's receive buffers) grows with
# the count: without a pipeline na = 3 (a first, a middle and a last micro-batch; the middle ones
# are identical); with one, na is the smallest count at which the schedule's own action list
# reaches the same number of micro-batches in flight per stage as at n (`in_flight`).


def in_flight(schedule, pp_rank: int) -> dict[int, tuple[int, int, int]]:
    """Per stage of this rank, from the schedule's own action list: the most micro-batches whose
    forward has run and whose input backward has not (activations held); the same once the stage
    has run a backward (activations held beside the gradients); and the most whose input backward
    has run and whose weight backward has not (zero-bubble's held inputs)."""
    from torch.distributed.pipelining.schedules import (
        BACKWARD_INPUT,
        BACKWARD_WEIGHT,
        FORWARD,
        FULL_BACKWARD,
        OVERLAP_F_B,
    )

    held: dict[int, list[int]] = defaultdict(
        lambda: [0, 0, 0, 0, 0, 0]
    )  # now, I-W now, maxima, backward seen
    for action in (schedule.pipeline_order or {}).get(pp_rank, []):
        if action is None:
            continue
        h, kind = held[action.stage_index], action.computation_type
        if kind in (FORWARD, OVERLAP_F_B):
            h[0] += 1
        if kind in (FULL_BACKWARD, BACKWARD_INPUT, OVERLAP_F_B):
            h[0] -= 1
            h[5] = 1
        if kind == BACKWARD_INPUT:
            h[1] += 1
        if kind == BACKWARD_WEIGHT:
            h[1] -= 1
        h[2] = max(h[2], h[0])
        h[3] = max(h[3], h[0] if h[5] else 0)
        h[4] = max(h[4], h[1])
    return {stage: (h[2], h[3], h[4]) for stage, h in sorted(held.items())}


def cheaper(na: int, nb: int, n: int, steps: int, ddp: bool = False) -> bool:
    """Whether sampling runs fewer micro-batches than the job's own steps: it runs three steps (nb,
    na, nb; DDP four: nb, nb, na, nb, see `per_step`), every step of the job runs n (gpt/tiny's 4
    micro-batches a rank: 11 against 8)."""
    return (2 + ddp) * nb + na < steps * n


# DDP rebuilds its gradient buckets once, at the second step's first forward (dryrun/patches.py
# `ddp_bucket_indices_on_the_host`; the planner's phase "DDP bucket rebuild"): the new buckets are
# allocated while the old ones are alive, the gradients twice beside the parameters, the optimizer
# state and the step's input batch. Sampled as nb, na, nb, that moment fell in the na step, and the
# peak scaled between a step with it and one without (params-heavy gpt/tiny, dp 2, 8 micro-batches:
# 15,725,760 B where every micro-batch run reads 34,306,200 B). A DDP job's sampled steps are
# nb, nb, na, nb: the rebuild in the second (nb), the last two steady, and the rebuild moment
# scaled to n by what a micro-batch adds to the forward-backward's peak (its share of the input
# batch; the step's own peak there is the optimizer's, which does not grow: 34,305,176 B at 8 and
# at 16 micro-batches, where the rebuild holds 1,024 B and 3,072 B more).


def sampled_steps(counts: tuple[int, int], ddp: bool) -> list[int]:
    """The micro-batch count of each sampled step: nb first (pipelining sizes its per-micro-batch
    infrastructure on its first step), under DDP nb again (its bucket rebuild, above), then na and
    nb, both with optimizer state: the two points every count is scaled from."""
    na, nb = counts
    return [nb] * (1 + ddp) + [na, nb]


def sampled_counts(trainer, n: int, steps: int = 2, ddp: bool = False) -> tuple[int, int] | None:
    """(na, nb) to simulate instead of the job's n micro-batches in each of `steps` steps, or None
    to run all n (when sampling would not be cheaper)."""
    schedule = trainer.model.schedule
    if schedule is None:
        na, nb = 3, 4
        return (na, nb) if cheaper(na, nb, n, steps, ddp) else None
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

    pp_rank = trainer.coords["pp"]
    want = in_flight(schedule, pp_rank)
    # Zero bubble: at the first count that reaches the job's in-flight counts the step's last
    # moments are still its first of their kind -- a chunk's first input-gradient step after a
    # weight step is where FSDP turns the 16-bit weight gradients into its fp32 accumulators, so
    # the peak there lacks state every later round holds; scaled from that count the difference
    # was taken per micro-batch (GPT-3 13B interleaved ZB v2, last stage, from 4 and 6 of 256:
    # 55.7 GB; from 6 and 8: 19.4 GB). The next two counts are taken.
    skip = 1 if isinstance(schedule, (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)) else 0
    # The interleaved schedules run rounds of `microbatches_per_round` (n / max(1, n // pp)): a
    # count with other rounds is another schedule -- a longer warm-up, one more micro-batch in
    # flight -- even where `in_flight`'s maxima agree, and what it adds was scaled per micro-batch
    # (GPT-3 175B interleaved v 2, pp 16, 192 micro-batches, sampled from 48 and 51 (rounds of 17):
    # +9.5 GiB on rank 0). Only counts with the job's rounds are taken.
    per_round = getattr(schedule, "microbatches_per_round", None)
    legal = []
    for k in range(1, n):
        try:
            candidate = patches.reschedule(schedule, k)
        except Exception:  # the schedule's own rules (e.g. 1F1B: at least one per stage)
            continue
        if getattr(candidate, "microbatches_per_round", None) != per_round:
            continue
        if legal or in_flight(candidate, pp_rank) == want:
            legal.append(k)
        if len(legal) == 2 + skip:
            na, nb = legal[skip:]
            return (na, nb) if cheaper(na, nb, n, steps) else None
    return None


def use_microbatches(trainer, full_schedule, k: int) -> None:
    """Make the trainer's next steps run k micro-batches: its data yields k (the same micro-batch
    size), and a pipeline runs the same schedule class for k, keeping its stages' metadata."""
    import dataclasses

    data = trainer.data
    trainer.data = dataclasses.replace(
        data, num_microbatches=k, global_batch_size=k * data.micro_batch_size * data.dp_size
    )
    if full_schedule is None:
        return
    schedule = trainer.model.schedule
    if patches.microbatch_count(schedule) != k:
        trainer.model.schedule = patches.reschedule(schedule, k)
    # the receive buffers of micro-batches this step does not run are set aside (not held), and
    # put back when a later step runs them again
    for stage in trainer.model.stages:
        for infos in (stage.args_recv_info, stage.grad_recv_info):
            aside = SET_ASIDE.setdefault(id(infos), {})
            for chunk in [c for c in infos if c >= k]:
                aside[chunk] = infos.pop(chunk)
            for chunk in [c for c in aside if c < k]:
                infos[chunk] = aside.pop(chunk)


SET_ASIDE: dict[int, dict[int, Any]] = {}




def affine(a, b, na: int, nb: int, n: int):
    """X(n) from X(na) = a and X(nb) = b, element-wise over nested dicts of numbers."""
    if isinstance(a, dict) or isinstance(b, dict):
        a, b = a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {}
        return {k: affine(a.get(k, 0), b.get(k, 0), na, nb, n) for k in {*a, *b}}
    return a + (n - na) * (b - a) / (nb - na)


# ------------------------------------------------------------------------------------------------
# Layer sampling. A stage of alike blocks (GPT's, ERNIE's) repeats the same block work L times: its
# chunks are simulated with 1 and 2 blocks each instead (zero bubble: 2 and 3; under full recompute
# only, see below) (two trainers, each sampling micro-batches
# as above), and every count -- FLOPs, collective bytes and calls, the live-tensor peak and the
# bytes of each state category -- is taken as affine in the block count, X(L) = X(a) + (L - a)
# (X(b) - X(a)). That is exact for FLOPs, bytes and the state (each block holds and computes the
# same, the ZeRO-1 and FSDP shards are per parameter). The peak is scaled per moment of the step
# (each pipeline stage's forwards, backwards and weight steps, then the rest: which one peaks can
# change with the count), and is exact when
# each part's peak holds the same per-block tensors at both counts as at L (in-flight activations,
# gradients and state grow with L; one block's temporaries do not):
# tests/integration/test_dryrun.py holds it against the run of every block. Only when every
# block is alike (the planner's units, names aside), every chunk of this rank holds the same
# count, and sampling is cheaper; otherwise every block runs.

# Where block counts scale exactly, measured against the run of every block
# (tests/integration/test_dryrun.py and probes on gpt/tiny): pipeline stages under full recompute --
# a block keeps only its input until its backward and is recomputed and back-propagated alone, and
# a pipelined chunk's parameters stay gathered for the whole step -- at 1 and 2 blocks (pp 2 with
# FSDP over dp, or with ZeRO-1; TP with sequence parallel). Elsewhere every block runs, because the
# peak is not affine in the block count:
# - without recompute (pp 2 ZeRO-1 stage 0 grows 1,128,256 B a block from 1 to 3 blocks,
#   1,147,192 B to 4, 1,192,448 B a block from 4 to 7);
# - FSDP without a pipeline, which gathers each block's parameters as the block before it runs
#   (ZeRO-3 without recompute grows 470,560 B from 1 to 2 blocks, then 339,232 B a block; with
#   full recompute 2 and 3 blocks scale 38% high at 7).
# The zero-bubble schedules take 2 and 3 blocks: from 1 to 2 blocks a chunk their weight and
# backward steps grew one 16-bit boundary activation less than from 2 on (gpt/tiny interleaved
# zero bubble v 2, pp 2 x dp 2, bf16, full recompute: the last chunk's weight step 2,797,448 /
# 4,788,104 / 6,786,952 B at 1 / 2 / 3 blocks, then 1,998,848 B a block).
LAYER_SAMPLES = (1, 2)
ZERO_BUBBLE_LAYER_SAMPLES = (2, 3)


def sampled_layers(cfg, rank: int) -> tuple[int, tuple[int, int]] | None:
    """This rank's blocks per chunk and the two block counts to simulate instead, or None (every
    block runs): the blocks must be alike, every chunk of this rank must hold the same count, and
    sampling must be cheaper (three steps at each of two counts a + b < the count, ends aside)."""
    from dataclasses import replace

    from fleetwise.config.layout import Layout
    from fleetwise.plan.chunks import split_ends, units_of
    from fleetwise.plan.pipeline import chunk_ranks, split_layers

    m = cfg.model
    if "num_layers" not in type(m).model_fields:  # the family's blocks are not a count (ResNet, CTR)
        return None
    blocks = split_ends(units_of(m)).blocks
    if len(blocks) != m.num_layers or len({repr(replace(u, name="")) for u in blocks}) != 1:
        return None
    layout, s = Layout.of(cfg), cfg.strategy
    if s.recompute != "full" or layout.pp == 1:
        return None
    chunks = layout.pp * s.virtual_stages
    owners = chunk_ranks(s.schedule, layout.pp, s.virtual_stages)
    counts = split_layers(m.num_layers, chunks, s.layer_split)
    mine = {counts[c] for c in range(chunks) if owners[c] == layout.coords(rank)["pp"]}
    samples = ZERO_BUBBLE_LAYER_SAMPLES if "zero_bubble" in s.schedule else LAYER_SAMPLES
    if len(mine) != 1 or min(mine) <= sum(samples) + 1:
        return None
    return mine.pop(), samples


def with_layers(cfg, per_chunk: int):
    """The job with `per_chunk` blocks in every pipeline chunk (everything else unchanged)."""
    from fleetwise.config.layout import Layout

    layout, s = Layout.of(cfg), cfg.strategy
    chunks = layout.pp * s.virtual_stages if layout.pp > 1 else 1
    model = cfg.model.model_copy(update={"num_layers": per_chunk * chunks})
    update = {"model": model}
    if layout.pp > 1 and s.layer_split is not None:
        update["strategy"] = s.model_copy(update={"layer_split": [per_chunk] * chunks})
    return cfg.model_copy(update=update)


def one_mesh() -> None:
    """Build the job's DeviceMesh once in this process (layer sampling builds two trainers): a
    second mesh would make a second set of process groups, and the counts are labelled by group.
    A real rank builds one mesh too."""
    from fleetwise.config.layout import Layout

    if hasattr(Layout.build_mesh, "original"):  # installed already
        return
    original, meshes = Layout.build_mesh, {}

    def build_mesh(layout, device_type: str):
        key = (layout.shape, device_type)
        if key not in meshes:
            meshes[key] = original(layout, device_type)
        return meshes[key]

    build_mesh.original = original
    Layout.build_mesh = build_mesh
