"""The analytic planner: memory per device, FLOPs, communication, bubble and step time.

Everything here is arithmetic on the validated config (no torch). Sources of the formulas:
- Memory of model states: ZeRO (Rajbhandari et al. 2020, section 3): fp32 params 4 B, grads 4 B,
  optimizer k·4 B per parameter, divided by the sharding degree as each stage shards them; mapped
  onto what FSDP2 / DDP / fleetwise's ZeRO-1 actually keep (see config/engine.py).
- Activations: Korthikanti et al. 2022 per-layer accounting, redone for this engine (plan/units.py),
  times the micro-batches each pipeline schedule keeps in flight (plan/pipeline.py).
- FLOPs: 2 FLOPs per multiply-add, training = 3 × forward (Kaplan et al. 2020; Narayanan et al.
  2021 eq. 3 without recompute): 6·N·tokens + attention 12·L·s·h·tokens for transformers.
- Communication: ring collectives (all-reduce moves 2(n-1)/n of the buffer per device,
  all-gather and reduce-scatter (n-1)/n), Thakur et al. 2005.
- Time: GEMMs at a fraction of peak that depends on their size (the calibrated curve; else
  `matmul_efficiency`), plus host time per op (`op_overhead_us` × the forward ops of each unit,
  backward included; more under tensor parallelism: `dtensor_op_us`, per convolution:
  `conv_call_us`, and per recomputed op: `checkpoint_op_us`) and per element the other
  ops write (`elementwise_ns`) and per gradient element a micro-batch adds into the step's
  (`grad_accumulate_ns`), stretched by the pipeline bubble; plus the communication that is
  not overlapped with compute (latency per call + bytes over bandwidth); FSDP's host work per unit,
  micro-batch and parameter tensor (`fsdp_us_per_tensor`), ZeRO-1's per parameter tensor in every micro-batch
  (`zero1_us_per_tensor`: its gradient hook) and once a step (`zero1_step_us_per_tensor`); plus the parameter
  update once per step (a cost per tensor and per element). `fleetwise calibrate` measures all of these constants. CPU ranks that
  outnumber the cores (`host_cores`) time-share them: their host and communication time stretch by
  ranks per core (their FLOP/s share is already peak / ranks); ranks that share a node also slow
  each other down (`co_run_slowdown`, measured with every core running a rank in lockstep).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cache

from fleetwise.config.engine import (
    ZERO1_BUCKET_ELEMENTS,
    dp_engine,
    optimizer_state_factor,
    reshard_after_forward,
)
from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import CollectiveStrategy, PSStrategy
from fleetwise.families import family_of, model_units
from fleetwise.plan.pipeline import (
    bubble_fraction,
    chunk_ranks,
    chunks_in_flight,
    is_interleaved,
    split_layers,
    weight_steps_waiting,
    zbv_cool_down,
    zbv_sends_made,
)
from fleetwise.plan.ps import placement as ps_placement
from fleetwise.plan.records import Memory, Plan
from fleetwise.plan.units import Unit

FP32 = 4


# --------------------------------------------------------------------------------------------------
# Stage assignment


def assign_units(cfg: RunConfig, layout: Layout) -> list[list[Unit]]:
    """Units of each pipeline chunk (pp × virtual_stages chunks; one chunk without pipelining)."""
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    units = _units(cfg.model)
    chunks = layout.pp * s.virtual_stages if layout.pp > 1 else 1
    explicit = tuple(s.layer_split) if layout.pp > 1 and s.layer_split else None
    key = (id(units), chunks, explicit)
    if key not in _CHUNKS_CACHE:
        _CHUNKS_CACHE[key] = _assign(units, chunks, explicit)
    return _CHUNKS_CACHE[key]


def _assign(units: list[Unit], chunks: int, explicit: tuple[int, ...] | None) -> list[list[Unit]]:
    first, blocks, last = _ends(units)
    split = split_layers(len(blocks), chunks, list(explicit) if explicit else None)
    out, i = [], 0
    for c, count in enumerate(split):
        chunk = list(blocks[i : i + count])
        i += count
        if c == 0:
            chunk = first + chunk
        if c == chunks - 1:
            chunk = chunk + last
        out.append(chunk)
    return out


# A layout search plans thousands of layouts of one model: its units (pure arithmetic on the model
# config, a third of a plan's time for a 96-layer GPT) are built once per model. Units are frozen.
# Equal units (a model's blocks, names aside) share a class key, so per-unit arithmetic is done
# once per class: id(unit) -> key, for the cached units only (they stay alive in the cache).
_UNITS_CACHE: dict[str, list[Unit]] = {}
_UNIT_CLASS: dict[int, str] = {}
# ... and so are its chunk assignments (callers never mutate them), keyed by the cached units'
# id, so that what is derived from a chunk list (the ranks' roles) can be cached by its id too
_CHUNKS_CACHE: dict[tuple, list[list[Unit]]] = {}
_ROLES_CACHE: dict[tuple, list[tuple]] = {}
_GROUPS_CACHE: dict[int, tuple[list[Unit], list[tuple[Unit, int]]]] = {}
_AGAIN_CACHE: dict[tuple[bool, int], tuple[list[list[Unit]], dict[int, int]]] = {}


def _units(model) -> list[Unit]:
    key = model.model_dump_json()
    if key not in _UNITS_CACHE:
        if len(_UNITS_CACHE) > 64:
            for cache in (
                _UNITS_CACHE,
                _UNIT_CLASS,
                _CHUNKS_CACHE,
                _ROLES_CACHE,
                _GROUPS_CACHE,
                _AGAIN_CACHE,
            ):
                cache.clear()
        units = model_units(model)
        classes: dict[str, str] = {}
        for u in units:
            sig = repr(replace(u, name=""))
            _UNIT_CLASS[id(u)] = classes.setdefault(sig, sig)
        _UNITS_CACHE[key] = units
    return _UNITS_CACHE[key]


def _unit_groups(chunk: list[Unit]) -> list[tuple[Unit, int]]:
    """The chunk's units by class (`_UNIT_CLASS`; a unit outside it is its own), each once with its
    count, in order of first appearance: sums over a chunk's units are count × the class's term."""
    held = _GROUPS_CACHE.get(id(chunk))
    if held is not None and held[0] is chunk:  # (the chunk is kept alive beside its groups)
        return held[1]
    groups: dict[object, list] = {}
    for u in chunk:
        key = _UNIT_CLASS.get(id(u), id(u))
        if key in groups:
            groups[key][1] += 1
        else:
            groups[key] = [u, 1]
    out = [(u, count) for u, count in groups.values()]
    if len(_GROUPS_CACHE) > 4096:
        _GROUPS_CACHE.clear()
    _GROUPS_CACHE[id(chunk)] = (chunk, out)
    return out


def _ends(units: list[Unit]) -> tuple[list[Unit], list[Unit], list[Unit]]:
    first = [u for u in units if u.kind == "embedding"]
    blocks = [u for u in units if u.kind == "block"]
    last = [u for u in units if u.kind == "head"]
    return first, blocks, last


# --------------------------------------------------------------------------------------------------
# Collective plan


def _act_bytes(precision: str, engine: str, convolutional: bool = False) -> tuple[int, int]:
    """(bytes of matmul outputs, bytes of the residual stream / norm inputs). Autocast computes
    matmuls in 16 bits but keeps the residual stream in fp32; FSDP's MixedPrecisionPolicy casts
    the parameters instead (no autocast, see the trainer), so everything runs in 16 bits. A
    convolutional network under autocast is 16-bit throughout: BatchNorm is on none of autocast's
    lists, so it keeps its 16-bit input's dtype, and so do ReLU, pooling and the residual adds
    (dry run of ResNet-50 dp 256, fp16: +74% before)."""
    if precision == "fp32":
        return FP32, FP32
    if convolutional:
        return 2, 2
    # ZeRO-1's working weights are 16-bit: the embedding's output, and so the residual stream, is too
    return (2, 2) if engine in ("fsdp", "zero1") else (2, FP32)


def _rank_memory(
    cfg: RunConfig, layout: Layout, chunks: list[list[Unit]], ranks: list[int], rank: int, n: int
) -> tuple[Memory, float]:
    """Peak memory of pipeline rank `rank` and its parameter count (after mp split, before sharding)."""
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    mp, sh, b = layout.mp, layout.sharding, cfg.train.micro_batch_size
    engine = dp_engine(layout, s.sharding_stage)
    local = [c for c, r in enumerate(ranks) if r == rank]
    # equal units once, with their count (a 96-layer chunk is a few classes: a search plans thousands)
    units = [g for c in local for g in _unit_groups(chunks[c])]
    p = sum(count * u.params_on_rank(mp) for u, count in units)
    block_params = sum(
        count * u.params_on_rank(mp) for u, count in units if u.kind == "block"
    )  # the rest is the root's (embedding, head, norm)
    k = optimizer_state_factor(cfg.optim.name, cfg.optim.momentum)
    mixed = cfg.train.precision != "fp32"
    offloaded = s.offload and cfg.hardware.device_type == "cuda" and engine == "fsdp"
    pipelined = layout.pp > 1
    accumulating = n > 1 or pipelined

    mem = Memory()
    shard = sh if engine == "fsdp" else 1
    resting = 0.0 if offloaded else FP32 * p / shard
    gather_bytes = 2 if mixed else FP32  # FSDP MixedPrecisionPolicy gathers in the compute dtype
    if engine == "fsdp":
        if reshard_after_forward(s.sharding_stage) and not pipelined:
            # each block is an FSDP unit; the rest of the chunk (embedding, head, final norm) is
            # the root unit, which FSDP2 never reshards after forward (its parameters are needed
            # again first in backward): in backward the root, the block in use and the prefetched
            # next one are gathered at once
            blocks = [u.params_on_rank(mp) for u, _ in units if u.kind == "block"]
            root = p - block_params
            working = gather_bytes * (root + 2 * max(blocks, default=0.0))
        else:  # stage 2 / replication, and any pipelined FSDP (kept gathered across micro-batches)
            working = gather_bytes * p
        mem.params = resting + working
        grads_sharded = 0.0 if offloaded else FP32 * p / sh
        # Under a pipeline schedule FSDP2 accumulates unsharded gradients (in the fp32 reduce
        # dtype) over the micro-batches and reduce-scatters them once, after the last backward
        # (torch.distributed.pipelining's REDUCE_GRAD), freeing each unit's unsharded gradients as
        # its sharded ones appear; the optimizer's zero_grad left no sharded gradients behind: one
        # fp32 copy of the chunk's gradients at most.
        mem.grads = FP32 * p if pipelined else grads_sharded
        mem.optimizer = 0.0 if offloaded else k * FP32 * p / sh
    elif engine == "zero1":
        # runtime/zero1.py: 16-bit working weights and the fp32 gradient buffer whole; fp32 masters
        # (under fp32 the working weights are their own masters) and optimizer state sharded
        mem.params = (2 if mixed else FP32) * p
        mem.grads = FP32 * p
        mem.optimizer = (k + (1 if mixed else 0)) * FP32 * p / sh
    else:
        mem.params = FP32 * p + (2 * p if mixed else 0.0)  # + autocast's low-precision weight cache
        mem.grads = FP32 * p
        mem.optimizer = k * FP32 * p

    split_bytes, whole_bytes = _act_bytes(cfg.train.precision, engine, family_of(cfg.model).convolutional)
    flight = chunks_in_flight(s.schedule, layout.pp, s.virtual_stages if pipelined else 1, n, rank)
    # a parameter's fresh gradient before autograd adds it into .grad: while gradients accumulate
    # (DDP's no_sync, no data parallelism, and FSDP under a pipeline schedule, which reduces once
    # after the last micro-batch); ZeRO-1's hook adds it into its fp32 buffer, in every
    # micro-batch; FSDP without a pipeline reduce-scatters each unit's gradients instead (its
    # buffers are in `working`)
    if engine == "zero1":
        fresh = FP32 if not mixed else 2
    elif engine == "fsdp":
        fresh = gather_bytes if pipelined else 0.0
    else:
        fresh = FP32 if accumulating else 0.0
    acts, transient, one_micro_batch = 0.0, 0.0, 0.0
    head_peak, body_peak = 0.0, 0.0  # the loss's backward peak, and every other unit's
    loss_done = 0.0  # what the activations change by once the loss's backward is done
    head_saved = 0.0  # what the head saves for its backward, one micro-batch
    block_saved = 0.0  # what a block saves for its backward, one micro-batch
    # Interleaved zero bubble: every rank peaks in a weight step on its last local chunk
    # (pipeline.weight_steps_waiting), with micro-batches waiting for theirs (rank 0 too: its first
    # chunk's one full backward is not the moment; gpt/tiny pp 2 v 2, 16 layers, rank 0 was -7.0%)
    waiting = weight_steps_waiting(s.schedule, layout.pp, s.virtual_stages, n, rank) if pipelined else {}
    weight_wait, weight_step = 0.0, 0.0  # what waiting adds; the weight step's own peak
    # ZB-V's cool-down moment (pipeline.zbv_cool_down): per local chunk, one micro-batch's saved
    # activations and the output gradients it keeps from its input-gradient step to its weight step
    cool = zbv_cool_down(layout.pp, n, rank) if pipelined and s.schedule == "ZBV_zero_bubble" else None
    chunk_saved, chunk_kept = [0.0] * len(local), [0.0] * len(local)

    def saved_bytes(a) -> float:  # per sample, on this rank
        return (
            (a.split / mp) * split_bytes
            + (a.sp / mp if s.sequence_parallel else a.sp) * whole_bytes
            + a.whole * whole_bytes
            + (a.reduced / mp if s.sequence_parallel else a.reduced) * split_bytes
            + (a.fp32 / mp) * FP32
            + a.partial * split_bytes
        )

    memo: dict[str, tuple[float, float]] = {}  # equal units (the blocks) are worked out once
    for i, c in enumerate(local):
        for u, count in _unit_groups(chunks[c]):
            key = _UNIT_CLASS.get(id(u))
            known = memo.get(key) if key is not None else None
            if known is None:
                a = u.saved(s.recompute)
                per_sample = saved_bytes(a)
                short = u.transient_tp if mp > 1 and u.transient_tp is not None else u.transient
                peak = b * short.elements(mp, s.sequence_parallel) * FP32
                # the unit's own backward: its gradient temporaries beside its saved activations,
                # with its largest parameter's fresh gradient and, under recompute, what the
                # recompute re-materialises (full: all but the block's input; selective: what it
                # does not keep)
                own = b * u.backward_transient.elements(mp, s.sequence_parallel) * split_bytes
                if s.recompute != "none" and u.kind == "block":
                    own += b * max(0.0, saved_bytes(u.saved("none")) - per_sample)
                if own:
                    peak = max(peak, own + fresh * u.fresh_grad_on_rank(mp))
                if u.output_split:
                    # the loss's forward (ParallelModel.loss): the logits' fp32 upcast is alive
                    # beside the log-softmax output it saves; the 16-bit logits themselves die at
                    # the upcast (under a pipeline the stage holds them anyway: pipeline_buffers)
                    upcast = FP32 if split_bytes != FP32 else 0.0
                    peak = max(peak, b * u.output_split / mp * upcast)
                known = (per_sample, peak)
                if key is not None:
                    memo[key] = known
            acts += count * flight.get(i, 1) * b * known[0]
            if cool is not None:
                chunk_saved[i] += count * b * known[0]
                chunk_kept[i] += count * b * saved_bytes(u.weight_grad_outputs)
            wait = min(waiting.get(i, 0), flight.get(i, 1))
            if wait:
                # waiting for its weight step: the output gradients it reads, kept from its
                # input-gradient step, which freed the log-softmax output
                freed = u.saved(s.recompute).fp32 / mp * FP32
                weight_wait += count * wait * b * (saved_bytes(u.weight_grad_outputs) - freed)
            if waiting and c == local[-1]:
                # the weight step of one of them: torch runs its parameter groups from the chunk's
                # input up, each freeing its output gradients once its weight gradients exist; it
                # peaks in the first, with the first block re-run under recompute (once for all of
                # its groups, runtime/pipeline_stage.py) and a norm's small gradient
                rerun = saved_bytes(u.saved("none")) - saved_bytes(u.saved(s.recompute))
                weight_step = max(weight_step, b * rerun)
            one_micro_batch += count * b * known[0]
            transient = max(transient, known[1])
            if u.kind == "head":
                head_peak = max(head_peak, known[1])
                head_saved += count * b * known[0]
                # once the loss's backward is done: its log-softmax output freed, the logits'
                # gradient (in the matmul dtype) handed to the head
                loss_done = b * (u.output_split / mp * split_bytes - u.saved(s.recompute).fp32 / mp * FP32)
            else:
                body_peak = max(body_peak, known[1])
            if u.kind == "block":
                block_saved = max(block_saved, b * known[0])
    if pipelined:
        # under sequence parallelism a stage sends, receives and holds its sequence shard
        shard_of_seq = mp if s.sequence_parallel else 1
        in_step, pooled = _pipeline_buffers(chunks, local, flight, n, b, s.schedule, waiting or None, rank)
        if cool is not None:
            now, waits, to_come = cool
            cool_in_step, _ = _pipeline_buffers(
                chunks, local, flight, n, b, s.schedule, None, rank, now=now, to_come={0: to_come}
            )
            # a waiting micro-batch's last output gradient is the one it received (a gradient
            # receive set, counted there); the step running (on chunk 0) holds, at its end, all of
            # its own and a temporary of that size (dry run of gpt/tiny pp 4, 8 layers, rank 3: a
            # waiting micro-batch holds 10 of its block's 11 boundary-sized output gradients, the
            # step 12 at its peak, with the input gradient it sends)
            out = [b * chunks[c][-1].boundary_elements * whole_bytes / shard_of_seq for c in local]
            cool_acts = sum(now[i] * chunk_saved[i] for i in range(len(local)))
            cool_acts += sum(waits[i] * (chunk_kept[i] - out[i]) for i in range(len(local))) + out[0]
        mem.pipeline_buffers = in_step * whole_bytes / shard_of_seq
        # at the optimizer step the schedule is done: its held sends and kept outputs are gone
        # (torch drops the send Works when `step` returns), its pooled receive buffers stay
        # (runtime/pipeline_stage.py; GPT-3 13B zero bubble v 2, rank 0 was +3.4%: the step
        # phase with every send still held)
        step_buffers = pooled * whole_bytes / shard_of_seq
        last = len(chunks) - 1
        if last in local:  # the last stage's outputs (the logits), from each forward to its backward
            i = local.index(last)
            held = min(n, flight.get(i, 1)) - min(waiting.get(i, 0), flight.get(i, 1))
            mem.pipeline_buffers += held * b * chunks[last][-1].output_split / mp * split_bytes
    if fresh:
        transient = max(transient, fresh * max((u.fresh_grad_on_rank(mp) for u, _ in units), default=0.0))
    if s.schedule == "ZBV_zero_bubble" and pipelined:
        # ZB-V peaks inside an input-gradient step (torch 2.13's lists: each is followed at once by
        # its weight step, so none waits at the peak; gpt/tiny pp 2 rank 0: the last stage's, late
        # in the step). Its micro-batch keeps every output gradient it makes for that weight step
        # (`Unit.weight_grad_outputs`): near its end, those of all of the chunk's units at once
        # (gpt/tiny pp 2 rank 0: -3.33% without; pp 4 rank 0 -2.33%). Chunk 0 is left out: its
        # input needs no gradient (`block_recomputes`)
        for c in local:
            if c > 0:
                kept = sum(b * saved_bytes(u.weight_grad_outputs) for u in chunks[c])
                if c == len(chunks) - 1:
                    # the last stage receives no output gradient (elsewhere the received one is a
                    # pool set's, counted there, and the step's boundary-sized temporary matches
                    # it): here the temporary comes on top (dry run of gpt/tiny pp 2 and 4, rank 0:
                    # 18 boundaries at the step's peak, its 16 kept, the one it sends and that one)
                    seq_shard = mp if s.sequence_parallel else 1
                    kept += b * chunks[c - 1][-1].boundary_elements * whole_bytes / seq_shard
                transient = max(transient, kept)
    # zero bubble's weight step: not the input-gradient steps' temporaries (the loss's backward,
    # a block's input gradients), but the waiting micro-batches' output gradients
    mem.activations = acts + (weight_wait + weight_step if waiting else transient)
    # Every rank loads its share of the step's batch at once. On a GPU it stays in host memory and
    # each micro-batch is copied over in turn, except under a pipeline schedule, which takes the
    # whole batch on the device and splits it itself.
    on_device = n * b if (cfg.hardware.device_type == "cpu" or pipelined) else b
    mem.inputs = on_device * family_of(cfg.model).input_bytes(cfg.model)

    # Peak of forward/backward vs peak of the optimizer step (foreach AdamW keeps about one
    # parameter-sized temporary). DDP's gradients are its all-reduce buckets, held for the whole
    # job (gradient_as_bucket_view, zeroed in place: runtime/optim.py); micro-batches under no_sync
    # accumulate into them, so there is no second copy (the dry run agrees to the byte on gpt/tiny dp 2)
    grads_live = mem.grads if (accumulating or engine in ("ddp", "zero1")) else 0.0
    if pipelined and engine == "fsdp" and mixed and "zero_bubble" in s.schedule:
        # Zero bubble under FSDP's mixed precision: a chunk's weight-gradient pass leaves its
        # 16-bit gradients on the unsharded parameters, and FSDP adds them into its fp32
        # accumulators only at the chunk's next post-backward (the next micro-batch's input-gradient
        # pass) -- every local chunk but the first, which torch back-propagates in one pass, holds
        # its parameters' gradients once more in the gather dtype (dry run of GPT-3 13B, zero
        # bubble v 2, rank 0: 786 MB, -3.7% before)
        grads_live += gather_bytes * sum(u.params_on_rank(mp) for c in local if c != 0 for u in chunks[c])
    during = {
        "params": mem.params,
        "grads": grads_live,
        "optimizer": mem.optimizer,
        "activations": mem.activations,
        "inputs": mem.inputs,
        "pipeline_buffers": mem.pipeline_buffers,
    }
    phases = [("forward/backward", during)]
    if cool is not None:
        # ZB-V's cool-down: fewer micro-batches in flight, more of them waiting for their weight
        # steps (gpt/tiny pp 4, 8 layers: ranks 2 and 3 peak there, rank 3 was -12.7%)
        cool_buffers = cool_in_step * whole_bytes / shard_of_seq
        phases.append(
            (
                "cool-down input gradient",
                {**during, "activations": cool_acts, "pipeline_buffers": cool_buffers},
            )
        )
    if pipelined and s.schedule == "GPipe" and n > 1 and engine != "zero1":
        # GPipe runs every forward before any backward: at the first backward all n micro-batches'
        # activations are held but no gradient exists yet (zero_grad set them to None; ZeRO-1's
        # buffer stays); the gradients are whole once that backward is done, when one micro-batch
        # fewer is held. Neither moment holds both.
        phases = [
            ("forward/backward", {**during, "grads": 0.0}),
            ("backward", {**during, "activations": mem.activations - one_micro_batch}),
        ]
    if engine == "fsdp" and not pipelined:
        # FSDP without a pipeline, a block's backward (measured in the dry run of gpt/tiny and of
        # GPT-3 13B, ZeRO-3 x 8, mp 8): the head's saved activations are gone, and the root's
        # gradients so far (the head's, unsharded, in the gather dtype) wait for the root's
        # reduce-scatter at the end of the backward. The first block back peaks at fc2, with fc2's
        # fresh weight gradient. Every later block has one block's saved activations fewer, but
        # FSDP keeps the previous unit's fp32 reduce-scatter input until the next unit's
        # (reduce_scatter_states), and it peaks in its attention's backward, past the MLP's
        # temporaries, with all of the block's weight gradients
        blocks_ = [u for u, _ in units if u.kind == "block"]
        block = max((u.params_on_rank(mp) for u in blocks_), default=0.0)
        heads = sum(count * u.params_on_rank(mp) for u, count in units if u.kind == "head")
        first_grad = max((u.fresh_grad_on_rank(mp) for u in blocks_), default=0.0)
        mlp = max(
            (b * u.backward_transient.elements(mp, s.sequence_parallel) * split_bytes for u in blocks_),
            default=0.0,
        )
        first = acts - head_saved + body_peak + gather_bytes * (heads + first_grad)
        later = first - block_saved - mlp + gather_bytes * (block - first_grad) + FP32 * block
        # With one micro-batch no gradient exists before the backward: each block back adds its
        # sharded gradient (its reduce-scatter's output) as one block's saved activations go, so
        # the later blocks peak at the second block back, the one before the last, or the last,
        # where FSDP prefetches the root, not another block (dry run of a 0.84B GPT, 16 layers,
        # ZeRO-3 x 8, fp32: the 15th block back, with 14 blocks' gradients, was -6.9%; gpt/tiny
        # d 256 x 4 blocks, full recompute: the 3rd, with 2 of them and 2 blocks gathered)
        n_blocks = sum(count for u, count in units if u.kind == "block")
        made = 0.0 if (accumulating or offloaded) else FP32 * block / sh
        gathered = during["params"]
        ends = [(first, 0.0, gathered)]  # (activations, gradients made, parameters)
        if n_blocks > 1:
            ends.append((later, made, gathered))
        if n_blocks > 2:
            ends.append((later - (n_blocks - 3) * block_saved, (n_blocks - 2) * made, gathered))
            last = later - (n_blocks - 2) * block_saved
            ends.append((last, (n_blocks - 1) * made, gathered - gather_bytes * block))
        block_backward, made_grads, backward_params = max(ends, key=sum)
        backward = {
            **during,
            "params": backward_params,
            "activations": block_backward,
            "grads": during["grads"] + made_grads,
        }
        if not reshard_after_forward(s.sharding_stage):
            phases.append(("block backward", backward))
        # The root's reduce-scatter, the backward's last unit (FSDP runs it in its final callback,
        # after autograd is done): every unit resharded, every activation freed, but the root's
        # fp32 reduce-scatter input (its unsharded gradients) and output (its new sharded ones,
        # beside those of the micro-batches before, or of the units before under offload: those
        # are on the host) are alive, and so is the head's weight gradient in the gather dtype:
        # autograd still holds it (a real gloo run holds it too: measured with the dry run's fake
        # tensors and with real ones). It wins where the root dominates (a large vocabulary on a
        # small model: gpt/tiny, vocab 16k, ZeRO-2 x mp 2 was -3.07%). gloo reduces a copy of the
        # whole input, alive for the call (NCCL reduces in place): the input twice there (the same
        # row, dry run and real run: -20.2% without it)
        root = p - block_params
        head_grad = max((u.fresh_grad_on_rank(mp) for u, _ in units if u.kind == "head"), default=0.0)
        copies = 2 if cfg.hardware.backend == "gloo" else 1
        root_reduce_scatter = {
            "params": resting,
            "grads": grads_sharded + (FP32 * root / sh if n > 1 or offloaded else 0.0),
            "optimizer": mem.optimizer,
            "activations": copies * FP32 * root + gather_bytes * head_grad,
            "inputs": mem.inputs,
        }
    if engine == "fsdp" and reshard_after_forward(s.sharding_stage) and not pipelined and head_peak:
        # ZeRO-3: the loss's backward (its gradients of the log-softmax output and of the logits)
        # runs before any unit's backward gathers again, when every unit, the root included, has
        # resharded after its forward (measured in the dry run). The units' own backward peaks
        # come later, with the root and two blocks gathered.
        phases = [
            ("forward/backward", backward),
            (
                "loss backward",
                {**during, "params": resting, "activations": acts + head_peak},
            ),
        ]
    if engine == "fsdp" and reshard_after_forward(s.sharding_stage) and not pipelined:
        # ZeRO-3, the backward's first unit: the root (embedding, head, final norm) gathers again
        # once the loss's backward is done; while FSDP copies its parameters out of the
        # all-gather buffer both are alive: twice the root, beside everything saved
        root = p - block_params
        phases.append(
            (
                "root re-gather",
                {**during, "params": resting + 2 * gather_bytes * root, "activations": acts + loss_done},
            )
        )
    if engine == "fsdp" and not pipelined:
        phases.append(("root reduce-scatter", root_reduce_scatter))
    if not accumulating and engine not in ("ddp", "zero1"):
        phases.append(
            (
                "end of backward",
                {
                    "params": mem.params,
                    "grads": mem.grads,
                    "optimizer": mem.optimizer,
                    "activations": transient,
                    "inputs": mem.inputs,
                },
            )
        )
    # autocast's low-precision weight cache is gone by the optimizer step (cleared on leaving autocast)
    step_params = resting if engine == "fsdp" else (FP32 * p if engine in ("none", "ddp") else mem.params)
    step_grads = (0.0 if offloaded else FP32 * p / sh) if engine == "fsdp" else mem.grads
    # AdamW's sqrt(exp_avg_sq) and its quotient: on CUDA torch's multi-tensor step makes one for
    # every parameter at once; on CPU its per-tensor loop makes two of one tensor at a time
    # (runtime/optim.py: build_optimizer's foreach follows the job's device)
    own = sh if engine in ("fsdp", "zero1") else 1  # FSDP and ZeRO-1 step their pieces of each tensor
    if k != 2:
        mem.step_temporaries = 0.0
    elif cfg.hardware.device_type == "cuda":
        mem.step_temporaries = FP32 * p / own
    else:
        mem.step_temporaries = 2 * FP32 * max((u.largest_on_rank(mp) for u, _ in units), default=0.0) / own
    if offloaded:  # the step runs on the offloaded shards, in host memory (foreach too: the job's device's)
        mem.host = FP32 * p / sh * (2 + k) + mem.step_temporaries
        mem.step_temporaries = 0.0
    if engine == "zero1":
        # (the reduce-scatter is in place in the gradient buffer); after the update one bucket's
        # all-gather, in place: the whole bucket, in the working dtype
        bucket = min(p, ZERO1_BUCKET_ELEMENTS)
        gather = (2 if mixed else FP32) * bucket
        mem.step_temporaries = max(mem.step_temporaries, gather)
    phases.append(
        (
            "optimizer step",
            {
                "params": step_params,
                "grads": step_grads,
                "optimizer": mem.optimizer,
                "step_temporaries": mem.step_temporaries,
                "pipeline_buffers": step_buffers if pipelined else 0.0,
            },
        )
    )
    phase, parts = max(phases, key=lambda ph: sum(ph[1].values()))  # the first of equal peaks
    mem.total = sum(parts.values())
    mem.peak = {"phase": phase, "parts": {k: v for k, v in parts.items() if v}}
    return mem, p


def _pipeline_buffers(
    chunks: list[list[Unit]],
    local: list[int],
    flight: dict[int, int],
    n: int,
    b: int,
    schedule: str,
    waiting: dict[int, int] | None = None,
    rank: int = 0,
    now: dict[int, int] | None = None,
    to_come: dict[int, int] | None = None,
) -> tuple[float, float]:
    """Elements a pipeline rank holds beyond its units' saved activations, (during the step, at
    the optimizer step).

    During the step, per local chunk: the receive buffers of runtime/pipeline_stage.py (a set per
    micro-batch between its receive and the end of its backward, reused: `recv_buffer_sets`) for
    the activations it receives (all but the first chunk; those of in-flight micro-batches are the
    first block's saved input already) and for the gradients (all but the last chunk); and the
    outputs it sends on: each in-flight micro-batch's output is kept until its backward.

    torch's multi-stage schedules (interleaved, zero bubble, looped BFS: `is_interleaved`) keep
    every send's Work to the end of the step, and a gloo or NCCL Work holds the tensor it sends:
    there every output and every input gradient sent to another rank stays until the step ends.
    The rank's peak comes late in the step (measured in the dry run on gpt/tiny, pp 2, v 2: the
    gap grew by exactly one boundary tensor per send per micro-batch), so all n are counted --
    but the input gradients of micro-batches whose input-gradient step is still to come, where
    `waiting` names the peak's zero-bubble weight step (pipeline.weight_steps_waiting). ZB-V's
    first moment (n >= 2pp) is mid-step: there only the sends made by then are counted.

    At the optimizer step only the pooled receive sets remain, every one of them (the stage keeps
    them for its life).

    `now`, `to_come`: a later moment (ZB-V's cool-down, pipeline.zbv_cool_down), with `now`
    micro-batches in flight per local chunk (the pools made for `flight` stay) and `to_come` of a
    chunk's input gradients not sent yet."""
    mine, held_sends = set(local), is_interleaved(schedule)
    in_step = pooled = 0.0
    for i, c in enumerate(local):
        held = min(n, flight.get(i, 1))
        handed = (c - 1 in mine, c + 1 in mine)  # a neighbour on this rank (ZB-V's rank pp-1)
        pp = len(chunks) // len(local)
        # ZB-V's first moment is mid-step: only the sends made by then are held
        sent = (
            zbv_sends_made(pp, n, rank)
            if schedule == "ZBV_zero_bubble" and now is None and n >= 2 * pp
            else None
        )
        activations, gradients = recv_buffer_sets(schedule, n, held, rank, i, len(local), handed, pp)
        if now is not None:
            held = min(n, now.get(i, 0))
        if c > 0:
            boundary = b * chunks[c - 1][-1].boundary_elements
            pooled += activations * boundary
            received = max(0, activations - held)
            # input gradients sent back; looped BFS peaks at the end of its all-forward phase, before any
            if held_sends and c - 1 not in mine and schedule != "looped_BFS":
                if to_come is not None:
                    received += n - to_come.get(i, 0)
                elif sent is not None:
                    received += sent[1][i]
                else:
                    received += n if waiting is None else n - held + min(waiting.get(i, 0), held)
            in_step += received * boundary
        if c < len(chunks) - 1:  # outputs: sent to the next chunk's rank, or kept for the backward
            boundary = b * chunks[c][-1].boundary_elements
            pooled += gradients * boundary
            # (handed to a chunk on this rank, they are that chunk's activation receive sets)
            outputs = n if held_sends and c + 1 not in mine else 0 if c + 1 in mine else held
            if sent is not None and c + 1 not in mine:
                outputs = sent[0][i]
            in_step += (gradients + outputs) * boundary
    return in_step, pooled


def recv_buffer_sets(
    schedule: str,
    n: int,
    held: int,
    rank: int = 0,
    local: int = 0,
    virtual: int = 1,
    handed: tuple[bool, bool] = (False, False),
    pp: int = 0,
) -> tuple[int, int]:
    """Sets of receive buffers (activations, gradients) one pipeline chunk makes, for a chunk that
    holds `held` micro-batches in flight at its peak. Counted on gpt/tiny with 32 micro-batches
    (`pipeline receive buffers` in the rank logs): 1F1B and GPipe receive an activation only for
    a micro-batch about to run and a gradient only for the backward about to run (pp 4, 1F1B: 3,
    2, 1 activation sets on stages 1-3 = pp - r, one gradient set each); looped BFS posts every
    micro-batch's receives of a phase at once (32 and 32); the interleaved and zero-bubble
    schedules post ahead of their backwards (pp 2, v 2: up to 2 × the micro-batches in flight
    and 2 gradient sets; taken as the bound). Interleaved zero bubble, from torch 2.13's lowered
    action lists (each receive taken at its RECV action, given back at the micro-batch's weight
    step; pp 2-8, v 2-3; rank `rank`, local chunk `local` of `virtual`): its first local chunk
    2 × in flight, its last one in flight, r + 1 gradient sets (the bound was rank 0's 4 + 2 and
    2 + 2 for 2 + 1 and 1: planner +3.7% on gpt/tiny pp 2 v 2 rank 0). ZB-V, from the same lists
    (pp 2-8; local chunk 0 is stage r, 1 is stage 2pp-1-r): one activation set more than in flight
    on each chunk, r + 2 gradient sets on the first and r on the second (the bound was 2 x in
    flight and 2). Rank pp-1 hands its middle boundary to itself (`handed`: the previous, the
    next chunk is on this rank): torch's stage puts the output, the input gradient it hands over
    into the receiving chunk's set (set_local_fwd_input, set_local_bwd_input), taken at the
    handing chunk's forward or input-gradient step and given back at the receiving one's weight
    step: in flight activation sets, r + 1 gradient sets. With n = pp (no cool-down) every
    gradient set is given back before the next is taken: one."""
    if schedule == "interleaved_zero_bubble":
        acts = held if local == virtual - 1 and virtual > 1 else 2 * held
        return min(n, acts), min(n, rank + 1)
    if schedule == "ZBV_zero_bubble":
        acts = held if handed[0] else min(n, held + 1)
        if n < 2 * pp:
            return acts, 1
        return acts, min(n, rank + 1 if handed[1] else rank + 2 if local == 0 else rank)
    if schedule == "looped_BFS":
        return n, n
    if schedule in ("1F1B", "GPipe"):
        return held, min(n, 1)
    return min(n, 2 * held), min(n, 2)


def _device_flops_per_sample(u: Unit, recompute: str, mp: int = 1, recomputes: int = 1) -> float:
    """FLOPs a device computes for one sample through unit `u` (before the mp split), as torch's
    FlopCounterMode counts them: matmuls forward once and backward twice; flash attention forward
    once and backward 2.5 times (it recomputes the scores); full recompute re-runs a block's
    forward up to the last tensor its backward needs (`recompute_skipped_flops`); selective
    recompute under TP re-runs the row-parallel matmuls it keeps the reduced outputs of.
    `recomputes`: how many times the backward re-runs the block (`block_recomputes`)."""
    dense = u.fwd_flops - u.attn_flops
    done = 3 * dense + 3.5 * u.attn_flops
    if recompute == "full" and u.kind == "block":
        done += recomputes * (u.fwd_flops - u.recompute_skipped_flops)
    if recompute == "selective" and mp > 1:
        done += recomputes * u.selective_tp_recompute_flops
    return done


ZERO_BUBBLE = ("interleaved_zero_bubble", "ZBV_zero_bubble")


def block_recomputes(schedule: str, pp: int, chunks: list[list[Unit]]) -> dict[int, int]:
    """id(unit) -> how many times a checkpointed unit's forward is re-run in one micro-batch's
    backward. Once, except under the zero-bubble schedules: torch splits the backward into an
    input-gradient and a weight-gradient call (pipelining._backward), and a checkpointed block is
    recomputed in each (runtime/pipeline_stage.py runs each micro-batch's weight-gradient calls
    under one GraphExecGroup, or it would be once per parameter group). The first chunk is the
    exception: its input needs no gradient, so torch runs one full backward there."""
    twice = schedule in ZERO_BUBBLE and pp > 1
    held = _AGAIN_CACHE.get((twice, id(chunks)))
    if held is not None and held[0] is chunks:  # a search asks it of every candidate (read-only)
        return held[1]
    again = {id(u): 2 if twice and c > 0 else 1 for c, chunk in enumerate(chunks) for u in chunk}
    if len(_AGAIN_CACHE) > 4096:
        _AGAIN_CACHE.clear()
    _AGAIN_CACHE[(twice, id(chunks))] = (chunks, again)
    return again


def _pp_bytes_of_rank(
    chunks: list[list[Unit]], ranks: list[int], rank: int, n: int, b: int, residual: int
) -> float:
    """Bytes pipeline rank `rank` sends per step: each micro-batch's activations to the next chunk
    (all but the last chunk) and its input gradients to the previous one (all but the first), where
    that chunk is on another rank (ZB-V's rank pp-1 hands its middle boundary to itself; gpt/tiny
    pp 2 rank 1 was +100%)."""
    out = 0.0
    for c, owner in enumerate(ranks):
        if owner != rank:
            continue
        if c < len(chunks) - 1 and ranks[c + 1] != rank:
            out += n * b * chunks[c][-1].boundary_elements * residual
        if c > 0 and ranks[c - 1] != rank:
            out += n * b * chunks[c - 1][-1].boundary_elements * residual
    return out


def _mp_comm(
    cfg: RunConfig,
    layout: Layout,
    units: list[Unit],
    n: int,
    engine: str,
    recomputes: dict[int, int] | None = None,
) -> tuple[float, int]:
    """Tensor-parallel bytes a device sends per step, and calls, for its `units` (the DTensor plans
    of models/tp_plan.py, counted in the dry run's collectives). Per (seq, hidden) all-reduce of a
    block (`mp_allreduces`): forward, the row-parallel output (matmul dtype); backward, the
    column-parallel input's gradient (residual-stream dtype: autocast casts inside the linear).
    With sequence parallelism each becomes an all-gather + reduce-scatter pair of half the bytes
    each (forward: gather the norm output, scatter the partial sum; backward the reverse). The
    embedding's vocabulary-parallel output is all-reduced in forward (and, split along the
    sequence, gathered in backward); the column-parallel head all-reduces its input gradient
    (sequence parallel: gathers its input, scatters the gradient). Full recompute re-runs a
    block's forward collectives (`recomputes` times: block_recomputes)."""
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    mp, b, sp = layout.mp, cfg.train.micro_batch_size, s.sequence_parallel
    act, residual = _act_bytes(cfg.train.precision, engine, family_of(cfg.model).convolutional)
    half = (mp - 1) / mp  # an all-gather's or a reduce-scatter's share of the full tensor
    hidden = max((u.boundary_elements for u in units), default=0.0)
    vol, calls = 0.0, 0.0
    for u in units:
        size = b * (u.boundary_elements or hidden)
        if u.kind == "block":
            k = 2 * u.mp_allreduces
            vol += u.mp_allreduces * 2 * half * (act + residual) * size
            if s.recompute == "full":
                # torch's checkpoint stops recomputing once the saved tensors are back: a pre-LN
                # block's fc2 (`recompute_skipped_flops`) and its all-reduce / reduce-scatter are
                # not re-run; the gathers before attention and MLP are
                sums = u.mp_allreduces - (1 if u.recompute_skipped_flops else 0)
                again = (recomputes or {}).get(id(u), 1)
                vol += again * (
                    (half * (u.mp_allreduces * residual + sums * act) if sp else 2 * half * sums * act) * size
                )
                k += again * sums
            elif s.recompute == "selective" and sp:
                # the recompute gathers the norms' outputs again (as Megatron does); the
                # reduce-scatters' outputs are kept (runtime/recompute.py)
                again = (recomputes or {}).get(id(u), 1)
                vol += again * u.mp_allreduces * half * residual * size
                k += again * u.mp_allreduces / 2  # one call each (k counts pairs under SP)
        elif u.kind == "embedding":
            k = u.mp_allreduces * (2 if sp else 1)
            vol += u.mp_allreduces * (2 + sp) * half * residual * size
        elif u.kind == "head":
            k = 2 if sp else 1
            vol += 2 * half * residual * size
        else:
            k = 0
        calls += k * (2 if sp and u.kind == "block" else 1)
    if sp and engine in ("fsdp", "zero1"):
        # the norms' replicated weights see one sequence shard, so their gradient is a partial
        # sum: FSDP and ZeRO-1 take each micro-batch's gradient at once and all-reduce it over mp
        # first (in the parameters' dtype: 16-bit under mixed precision). The embedding's
        # replicated weights (positions) get a whole gradient: its output is all-reduced.
        grad_bytes = 2 if cfg.train.precision != "fp32" else FP32
        vol += 2 * half * grad_bytes * sum(u.params_whole for u in units if u.kind != "embedding")
    return n * vol, int(n * calls)


def _stage_comm(
    cfg: RunConfig,
    layout: Layout,
    chunks: list[list[Unit]],
    ranks: list[int],
    p: float,
    rank: int,
    n: int,
    engine: str,
    again: dict[int, int] | None = None,
) -> dict[str, int]:
    """Bytes a device of pipeline rank `rank` sends per step, by mesh dimension: gradient and
    parameter traffic for its own parameters `p`, pipeline traffic for its own chunks. `again`:
    block_recomputes of the chunks, when the caller has it."""
    vol, _, _ = _comm(cfg, layout, chunks, ranks, p, n, engine, data_parallel_only=True)
    residual = _act_bytes(cfg.train.precision, engine, family_of(cfg.model).convolutional)[1]
    # under sequence parallelism a stage sends its output's sequence shard
    residual /= layout.mp if cfg.strategy.sequence_parallel else 1
    vol["pp"] = _pp_bytes_of_rank(chunks, ranks, rank, n, cfg.train.micro_batch_size, residual)
    if layout.mp > 1:
        again = again if again is not None else block_recomputes(cfg.strategy.schedule, layout.pp, chunks)
        vol["mp"] = _mp_comm(cfg, layout, _rank_units(chunks, ranks, rank), n, engine, again)[0]
    return {d: int(v) for d, v in vol.items()}


def _role(chunks: list[list[Unit]], ranks: list[int], rank: int) -> tuple:
    """What pipeline rank `rank`'s work and traffic depend on: per local chunk, whether it is the
    first or the last one, its units (by class: equal units share one), the unit whose output
    it receives and whether its neighbours are on this rank (ZB-V's rank pp-1 sends nothing
    between its chunks: its pp bytes were +100%). Ranks with the same role compute and send the same."""
    last, cls = len(chunks) - 1, _UNIT_CLASS.get

    def keys(units: list[Unit]) -> tuple:
        ids = [id(u) for u in units]
        return tuple(map(cls, ids, ids))  # a unit outside the cache is its own class

    return tuple(
        (
            c == 0,
            c == last,
            keys(chunks[c]),
            keys(chunks[c - 1][-1:]) if c > 0 else None,
            c > 0 and ranks[c - 1] == rank,
            c < last and ranks[c + 1] == rank,
        )
        for c, r in enumerate(ranks)
        if r == rank
    )


def _roles(chunks: list[list[Unit]], ranks: list[int], pp: int) -> list[tuple]:
    """`_role` of every pipeline rank, once per chunk assignment (`assign_units` caches them)."""
    key = (id(chunks), tuple(ranks))
    if key not in _ROLES_CACHE:
        if len(_ROLES_CACHE) > 4096:
            _ROLES_CACHE.clear()
        _ROLES_CACHE[key] = [_role(chunks, ranks, r) for r in range(pp)] if pp > 1 else [()]
    return _ROLES_CACHE[key]


def _local_chunks(ranks: list[int], pp: int) -> list[list[int]]:
    """The chunks each pipeline rank holds, in order (one pass: a search plans thousands)."""
    out: list[list[int]] = [[] for _ in range(pp)]
    for c, r in enumerate(ranks):
        out[r].append(c)
    return out


def _rank_units(chunks: list[list[Unit]], ranks: list[int], rank: int) -> list[Unit]:
    """The units of every chunk pipeline rank `rank` holds."""
    return [u for c, r in enumerate(ranks) if r == rank for u in chunks[c]]


RankMemory = dict[int, tuple[Memory, float]]  # pipeline rank -> (its peak memory, its parameters)


def rank_memory(cfg: RunConfig, stop_above: float = math.inf) -> RankMemory:
    """The memory of the pipeline ranks that can hold the most (`_memory_ranks`), without timing
    the step: what a layout search asks first, to drop layouts that do not fit before planning
    them. `make_plan(cfg, memory=...)` takes it, so that a layout that fits is not worked out twice.
    `stop_above`: return as soon as one rank needs more (then only the ranks worked out so far,
    which a search that only drops the layout needs no more of; not for `make_plan`)."""
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    layout = Layout.of(cfg)
    n = cfg.train.accumulate_steps or 1
    chunks = assign_units(cfg, layout)
    v = s.virtual_stages if layout.pp > 1 else 1
    ranks = chunk_ranks(s.schedule, layout.pp, v) if layout.pp > 1 else [0]
    which = _memory_ranks(s, layout, chunks, ranks, n)
    return _memory_of(
        cfg, layout, chunks, ranks, n, which, roles=_roles(chunks, ranks, layout.pp), stop_above=stop_above
    )


def _memory_of(
    cfg: RunConfig,
    layout: Layout,
    chunks: list[list[Unit]],
    ranks: list[int],
    n: int,
    which: list[int],
    known: RankMemory | None = None,
    roles: list[tuple] | None = None,
    stop_above: float = math.inf,
) -> RankMemory:
    """`_rank_memory` of the pipeline ranks `which` (those in `known` taken from it), worked out
    once per memory role: ranks in the same role (`_role`) that keep as many micro-batches of each
    local chunk in flight, beside the same neighbours, hold the same (the inner ranks of a deep
    interleaved pipeline; of a 1F1B one while the micro-batches are fewer than the stages)."""
    s = cfg.strategy
    v = s.virtual_stages if layout.pp > 1 else 1
    out: RankMemory = {r: known[r] for r in which if known and r in known}
    todo = [r for r in which if r not in out]
    if len(todo) < 2:  # nothing to share
        return out | {r: _rank_memory(cfg, layout, chunks, ranks, r, n) for r in todo}
    by_key: RankMemory = {}
    local_chunks = _local_chunks(ranks, layout.pp)
    for r in todo:
        local = local_chunks[r]
        flight = chunks_in_flight(s.schedule, layout.pp, v, n, r) if layout.pp > 1 else {}
        key = (
            roles[r] if roles is not None else _role(chunks, ranks, r),
            tuple(flight.get(i, 1) for i in range(len(local))),
            tuple((c - 1 in local, c + 1 in local) for c in local),
            # interleaved zero bubble: rank r has r + 1 waiting for a weight step and r + 1
            # gradient receive sets, ZB-V r + 2 and r (recv_buffer_sets)
            tuple(sorted(weight_steps_waiting(s.schedule, layout.pp, v, n, r).items()))
            if layout.pp > 1
            else (),
            min(n, r + 1) if s.schedule == "interleaved_zero_bubble" else 0,
            min(n, r + 2) if s.schedule == "ZBV_zero_bubble" else 0,  # ZB-V's gradient receive sets
        )
        if key not in by_key:
            by_key[key] = _rank_memory(cfg, layout, chunks, ranks, r, n)
        out[r] = by_key[key]
        if out[r][0].total > stop_above:
            break
    return out


def worst_of(memory: RankMemory) -> float:
    """Bytes the worst device needs (the plan's memory_bytes["total"])."""
    return max(mem.total for mem, _ in memory.values())


def worst_memory(cfg: RunConfig) -> float:
    """Bytes the worst device needs (the plan's memory_bytes["total"]) without timing the step."""
    return worst_of(rank_memory(cfg))


def _memory_ranks(
    s: CollectiveStrategy, layout: Layout, chunks: list[list[Unit]], ranks: list[int], n: int
) -> list[int]:
    """Pipeline ranks that can hold the most memory. Ranks whose chunks are all inner ones (neither
    the first nor the last) with the same units differ only in the micro-batches they keep in flight,
    and their memory grows with that count (activations per micro-batch; their receive buffers
    add up to 2n whatever it is): of such a group only the rank with the most in flight is planned."""
    v = s.virtual_stages if layout.pp > 1 else 1
    return list(_memory_ranks_of(s.schedule, layout.pp, v, n, tuple(map(len, chunks)), tuple(ranks)))


@cache  # a search asks it of every candidate; it depends on the chunks' sizes only
def _memory_ranks_of(
    schedule: str, pp: int, v: int, n: int, sizes: tuple[int, ...], ranks: tuple[int, ...]
) -> tuple[int, ...]:
    last = len(sizes) - 1
    keep: list[int] = []
    groups: dict[tuple, list[tuple[tuple[int, ...], int]]] = {}
    for r, local in enumerate(_local_chunks(list(ranks), pp)):
        if 0 in local or last in local:
            keep.append(r)
            continue
        flight = chunks_in_flight(schedule, pp, v, n, r)
        counts = tuple(flight.get(i, 1) for i in range(len(local)))
        groups.setdefault(tuple(sizes[c] for c in local), []).append((counts, r))
    for members in groups.values():
        top = max(members)
        if all(all(a >= b for a, b in zip(top[0], m[0], strict=True)) for m in members):
            keep.append(top[1])
        else:  # no rank holds the most of every chunk: plan them all
            keep += [r for _, r in members]
    return tuple(keep)


def _collective_plan(cfg: RunConfig, memory: RankMemory | None = None, per_stage: bool = True) -> Plan:
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    layout = Layout.of(cfg)
    hw, t = cfg.hardware, cfg.train
    n = t.accumulate_steps or 1
    b = t.micro_batch_size
    chunks = assign_units(cfg, layout)
    v = s.virtual_stages if layout.pp > 1 else 1
    ranks = chunk_ranks(s.schedule, layout.pp, v) if layout.pp > 1 else [0]
    engine = dp_engine(layout, s.sharding_stage)

    # without the stages, only the ranks that can hold the most memory are planned (the worst is
    # one of them); the others' parameters are all the time model needs of them
    roles = _roles(chunks, ranks, layout.pp)  # see below
    if per_stage:
        planned = range(layout.pp)
    else:  # those of `memory` (rank_memory's) when given
        planned = memory.keys() if memory is not None else _memory_ranks(s, layout, chunks, ranks, n)
    memory = _memory_of(cfg, layout, chunks, ranks, n, sorted(planned), memory, roles)
    chunks_of = _local_chunks(ranks, layout.pp)
    rank_params = [
        memory[r][1]
        if r in memory
        else sum(
            count * u.params_on_rank(layout.mp) for c in chunks_of[r] for u, count in _unit_groups(chunks[c])
        )
        for r in range(layout.pp)
    ]
    worst = max(sorted(memory), key=lambda r: memory[r][0].total)
    mem = memory[worst][0]

    every = [g for c in chunks for g in _unit_groups(c)]
    params = sum(count * u.params for u, count in every)
    # training FLOPs: 3 × forward (backward = 2 × forward)
    flops_per_step = t.global_batch_size * 3 * sum(count * u.fwd_flops for u, count in every)

    # --- time ---------------------------------------------------------------------------------
    peak = hw.peak_flops(t.precision)
    recompute_extra = {"none": 0.0, "selective": 0.0, "full": 1.0}[s.recompute]
    bubble = bubble_fraction(s.schedule, layout.pp, v, n)
    # Ranks sharing a CPU node's cores (shared_compute) time-share them and slow each other down,
    # but a pipeline rank waiting in its bubble leaves its core to the others: the micro-batches'
    # work runs with only (1 - bubble) of the node's ranks busy at once, on average. The optimizer
    # step, after the schedule, has them all (gpt/tiny pp 4 on 2 cores measured 36 ms, where 2 ranks
    # per core on top of its bubble planned 70 ms). GPUs: both are 1.
    per_core = hw.ranks_per_core_at(1 - bubble)
    slow = hw.co_run_factor_at(1 - bubble)
    gemm_share = per_core / hw.ranks_per_core  # peak_flops is the node's FLOP/s over all its ranks
    # under tensor parallelism every op of every unit goes through DTensor (measured on 2 ranks
    # running together: its co-run slowdown is in it already)
    dtensor_us = hw.dtensor_op_us if layout.mp > 1 else 0.0
    op_s = (slow * hw.op_overhead_us + dtensor_us) * 1e-6 * per_core
    elem_s = slow * hw.elementwise_ns * 1e-9 * per_core
    # FSDP's host work (its hooks, the copies into and out of the flat collective buffers) runs for
    # every unit in every micro-batch's forward and backward, whatever the ZeRO stage; measured on
    # co-running ranks like DTensor's. A stage-3 re-gather adds only its collective's latency.
    fsdp_s = hw.fsdp_us_per_tensor * 1e-6 * per_core if engine == "fsdp" else 0.0
    # ... and its copies into and out of the flat collective buffers (the all-gather's copy-in of the
    # shard and copy-out into the unsharded parameters, the reduce-scatter's concatenation of the
    # gradients and copy-out of the shard): memory-bound passes over the unit's parameters at each
    # of its all-gathers and reduce-scatters, which the per-tensor probe (width 16) cannot see.
    # On a 6-layer d=512 GPT (19M parameters, 2 CPU ranks) ZeRO-2 ran ~300 ms a step behind DDP
    # where the plan had ~120 ms; calibrate's probe (units of 8.4M parameters) reads 2.3-3.5 ns per
    # element and collective on that machine, ~110 ms a micro-batch there.
    gathers, scatters = (
        _fsdp_collectives(s, layout, n) if engine == "fsdp" and layout.sharding > 1 else (0, 0)
    )
    fsdp_copy_s = (gathers + scatters) * hw.fsdp_ns_per_param * 1e-9 * per_core
    # ZeRO-1's own host work (runtime/zero1.py), measured on co-running ranks like FSDP's: a Python
    # gradient hook per parameter tensor in every micro-batch's backward, and per tensor once a
    # step the reduce's bookkeeping, the squared norms of its pieces and the all-gather's copies
    zero1_s = hw.zero1_us_per_tensor * 1e-6 * per_core if engine == "zero1" else 0.0
    zero1_step_s = hw.zero1_step_us_per_tensor * 1e-6 * hw.ranks_per_core if engine == "zero1" else 0.0
    # activation checkpointing's own machinery per forward op of a recomputed block, on top of the
    # re-run ops above (selective checkpointing's policy dispatch mode costs more than full)
    checkpoint_us = {"none": 0.0, "full": hw.checkpoint_op_us, "selective": hw.selective_checkpoint_op_us}
    checkpoint_s = slow * checkpoint_us[s.recompute] * 1e-6 * per_core
    # the parameter update (gradient norm, clipping, optimizer step) once per step, per tensor and
    # per element: calibrated with AdamW, scaled by the state tensors the optimizer reads and
    # writes (param and grad, plus k state tensors: SGD does less)
    k = optimizer_state_factor(cfg.optim.name, cfg.optim.momentum)
    update_scale = (2 + k) / 4 * hw.ranks_per_core * hw.co_run_factor
    update_shard = layout.sharding if engine in ("fsdp", "zero1") else 1
    # torch.distributed.pipelining's host work per schedule action (a micro-batch's pass through one
    # local stage with its send/receive): forward and backward, and zero-bubble schedules split the
    # backward into input- and weight-gradient actions. Measured on co-running stages, like DTensor's.
    pp_actions = (3 if "zero_bubble" in s.schedule else 2) if layout.pp > 1 else 0
    action_s = hw.pipeline_action_us * 1e-6 * per_core
    # torch's multi-stage schedules (PipelineScheduleMulti: the interleaved and zero-bubble ones) pay
    # more per action that sends and receives (a forward, a backward or input-gradient pass) than
    # the single-stage 1F1B that `pipeline_action_us` is measured on (calibrate's interleaved probe;
    # gpt/tiny pp 2, interleaved 1F1B v 2, measured 1.73x its plan where 1F1B and ZB-V ran 1.46-1.50x)
    multi_s = (
        hw.pipeline_multi_action_us * 1e-6 * per_core if is_interleaved(s.schedule) and layout.pp > 1 else 0.0
    )
    # ... and the zero-bubble split itself: torch's input-gradient pass keeps the graph for the
    # weight-gradient pass, which walks it again (host time per forward op) and makes a
    # memory-bound pass over the chunk's weights, in every chunk but the first (which torch runs as
    # one full backward). Measured by calibrate on fleetwise's own block; a 6-layer d=512 GPT on 2
    # CPU ranks ran ~4 ms per block and micro-batch longer under interleaved zero bubble than 1F1B.
    split = s.schedule in ZERO_BUBBLE and layout.pp > 1
    split_op_s = slow * hw.zero_bubble_split_op_us * 1e-6 * per_core
    split_param_s = slow * hw.zero_bubble_split_ns_per_param * 1e-9 * per_core
    # gradient accumulation: each micro-batch's gradient is added into the step's, a memory-bound
    # pass over the rank's gradients (every micro-batch into ZeRO-1's fp32 buffer, whose hook also
    # takes the first; under DDP autograd adds micro-batches 2..n into .grad; FSDP without a pipeline
    # reduce-scatters each micro-batch's and adds the shard, with one it accumulates them whole)
    adds = n if engine == "zero1" else n - 1
    accumulated_share = 1 / layout.sharding if (engine == "fsdp" and layout.pp == 1) else 1.0
    accumulate_s = slow * hw.grad_accumulate_ns * 1e-9 * per_core
    # (ZeRO-1's per-step passes below run at the optimizer step, every rank busy)
    step_pass_s = hw.co_run_factor * hw.grad_accumulate_ns * 1e-9 * hw.ranks_per_core
    # ZeRO-1's gather is memory-bound work over the whole bucket once a step, charged per element
    # like an accumulation pass: this rank's masters copied into its row and the other rows copied
    # out into the working weights (a pass in all), and on gloo first the zeroing of the buffer it
    # all-reduces (runtime/zero1.py)
    gather_passes = (2.0 if hw.backend == "gloo" else 1.0) if engine == "zero1" else 0.0
    stage_time, host_time, elementwise_time, update_time, device_flops = [], [], [], [], []
    accumulate_time, engine_step_time = [], []
    gemm_memo: dict[str, float] = {}  # GEMM efficiency per class of equal units
    again = block_recomputes(s.schedule, layout.pp, chunks)

    def rank_work(r: int) -> tuple[float, float, int, int, float, int, int, int, int, float]:
        """The step's GEMM seconds and device FLOPs of pipeline rank `r`,
        and per micro-batch its ops, re-run ops, elements written, convolutions, parameter
        tensors, local chunks, and the ops and parameters whose backward zero bubble splits."""
        gemm, done = 0.0, 0.0
        ops = redo_ops = elements = convs = tensors = split_ops = local_chunks = 0
        split_params = 0.0
        for c in (c for c, rr in enumerate(ranks) if rr == r):
            local_chunks += 1
            for u, count in _unit_groups(chunks[c]):  # equal units once (`again` is per chunk)
                # both recompute modes re-run every op of a block in backward (selective reads
                # saved matmul results back, but still dispatches the ops); zero bubble: twice
                rerun = again[id(u)] if s.recompute != "none" and u.kind == "block" else 0
                ops += count * u.fwd_ops
                redo_ops += count * rerun * u.fwd_ops
                elements += count * (1 + rerun) * u.fwd_elementwise
                convs += count * (1 + rerun) * u.fwd_convs
                tensors += count * u.param_tensors
                if split and c > 0:
                    split_ops += count * u.fwd_ops
                    split_params += count * u.params_on_rank(layout.mp)
                flops = b * u.fwd_flops / layout.mp  # one micro-batch's forward on this rank
                if flops:
                    passes = 3 + (recompute_extra * again[id(u)] if u.kind == "block" else 0.0)
                    key = _UNIT_CLASS.get(id(u))
                    fraction = gemm_memo.get(key) if key is not None else None
                    if fraction is None:
                        fraction = hw.gemm_fraction(flops / max(1, u.fwd_gemms))
                        if key is not None:
                            gemm_memo[key] = fraction
                    gemm += count * n * passes * flops / (peak * fraction)
                    per_sample = _device_flops_per_sample(u, s.recompute, layout.mp, again[id(u)])
                    done += count * n * b * per_sample / layout.mp
        return (
            gemm,
            done,
            ops + redo_ops,
            redo_ops,
            elements,
            convs,
            tensors,
            local_chunks,
            split_ops,
            split_params,
        )

    # ranks in the same role (the inner ranks of a deep pipeline) do the same work: counted once
    work_of: dict[tuple, tuple[float, float, int, int, float, int, int, int, int, float]] = {}
    for r in range(layout.pp):
        if roles[r] not in work_of:
            work_of[roles[r]] = rank_work(r)
        gemm, done, ops, redo_ops, elements, convs, tensors, local_chunks, split_ops, split_params = work_of[
            roles[r]
        ]
        device_flops.append(done)
        host_time.append(
            n
            * (
                ops * op_s
                + redo_ops * checkpoint_s
                + convs * slow * hw.conv_call_us * 1e-6 * per_core
                + tensors * (fsdp_s + zero1_s)
                + pp_actions * local_chunks * action_s
                + 2 * local_chunks * multi_s
                + split_ops * split_op_s
            )
            + rank_params[r] * fsdp_copy_s
        )
        elementwise_time.append(n * b * elements * elem_s)
        accumulate_time.append(
            adds * rank_params[r] * accumulated_share * accumulate_s + n * split_params * split_param_s
        )
        stage_time.append(
            slow * gemm_share * gemm + host_time[-1] + elementwise_time[-1] + accumulate_time[-1]
        )
        elements_updated = rank_params[r] / update_shard
        update_time.append(
            tensors * hw.update_us_per_tensor * 1e-6 + elements_updated * hw.update_ns_per_param * 1e-9
        )
        engine_step_time.append(tensors * zero1_step_s + gather_passes * rank_params[r] * step_pass_s)
    update = max(u * update_scale + e for u, e in zip(update_time, engine_step_time, strict=True))
    compute = max(stage_time)
    pipelined_compute = compute / (1 - bubble) if bubble < 1 else compute

    comm, calls, cost = _comm(cfg, layout, chunks, ranks, rank_params[worst], n, engine)
    bw = {dim: _bandwidth(cfg, layout, dim) for dim in ("dp", "sharding", "mp", "pp")}
    comm_time = {
        dim: (cost[dim] / bw[dim] + calls[dim] * _latency(cfg, layout, dim)) * hw.ranks_per_core
        for dim in comm
    }
    # Gradient all-reduce / reduce-scatter and FSDP gathers overlap with compute on GPUs (NCCL runs
    # on its own stream), but only with the compute that runs while they are in flight. On a CPU
    # the same cores run both, so nothing is hidden.
    overlappable = comm_time["dp"] + comm_time["sharding"]
    hidden = (
        min(overlappable, _overlap_window(engine, layout, n, compute)) if hw.device_type == "cuda" else 0.0
    )
    exposed = comm_time["mp"] + comm_time["pp"] + overlappable - hidden
    offload = _offload_time(cfg, engine, rank_params[worst], layout.sharding, n)
    step = pipelined_compute + exposed + update + offload
    mfu = flops_per_step / (step * layout.world_size * peak) if step > 0 else 0.0

    stages = []
    comm_of: dict[tuple, dict[str, int]] = {}  # per role, like the work
    for r in range(layout.pp) if per_stage else ():
        if roles[r] not in comm_of:
            comm_of[roles[r]] = _stage_comm(cfg, layout, chunks, ranks, rank_params[r], r, n, engine, again)
        units = [u for c, rr in enumerate(ranks) if rr == r for u in chunks[c]]
        stages.append(
            {
                "rank": r,
                "chunks": [c for c, rr in enumerate(ranks) if rr == r],
                "layers": sum(1 for u in units if u.kind == "block"),
                "params_per_device": int(rank_params[r] / (layout.sharding if engine == "fsdp" else 1)),
                "memory_total_bytes": int(memory[r][0].total),
                "host_memory_bytes": int(memory[r][0].host),  # offloaded state (GPU offload only)
                "memory_peak": memory[r][0].peak_ints(),  # this stage's peak phase and its parts
                "flops_per_device": device_flops[r],  # this device's FLOPs per step, recompute included
                # bytes this device sends per step, by mesh dimension (pp differs by stage)
                "comm_bytes_per_step": dict(comm_of[roles[r]]),
                "compute_s": stage_time[r],
            }
        )
    device_mem = hw.memory_per_device_bytes
    family = family_of(cfg.model)
    tokens = family.tokens_per_sample(cfg.model)
    notes = []
    if s.offload and hw.device_type == "cpu":
        notes.append("offload keeps state in host memory, which on a CPU device is the same memory")
    elif mem.host:
        notes.append(
            f"offload: {mem.host / 2**30:.2f} GiB of host memory per device at most (sharded params, grads, "
            "optimizer state and the optimizer step), not counted in the device's peak"
        )
    notes += family.plan_notes(cfg.model)
    if s.recompute != "none" and max(again.values(), default=1) > 1:
        once = [
            sum(
                count * n * b * _device_flops_per_sample(u, s.recompute, layout.mp) / layout.mp
                for c in chunks_of[r]
                for u, count in _unit_groups(chunks[c])
            )
            for r in range(layout.pp)
        ]
        extra = max(d / o - 1 for d, o in zip(device_flops, once, strict=True) if o)
        notes.append(
            f"strategy.schedule={s.schedule} with strategy.recompute={s.recompute}: torch's zero-bubble "
            "backward re-runs each checkpointed block in both its input- and weight-gradient passes "
            f"(not the first chunk): +{extra:.0%} FLOPs on the busiest stage, counted in the step time; "
            "1F1B or interleaved_1F1B recompute once"
        )
    if cfg.optim.warmup_steps > t.steps:
        notes.append(
            f"optim.warmup_steps={cfg.optim.warmup_steps} > train.steps={t.steps}: the warm-up is cut "
            f"short and the learning rate only reaches {t.steps}/{cfg.optim.warmup_steps} of optim.lr"
        )
    return Plan(
        world_size=layout.world_size,
        mesh=layout.as_dict(),
        params=int(params),
        batch={
            "global_batch_size": t.global_batch_size,
            "micro_batch_size": b,
            "accumulate_steps": n,
            "num_microbatches": n,
        },
        memory_bytes=mem.as_ints(),
        memory_peak=mem.peak_ints(),
        device_memory_bytes=device_mem,
        fits=mem.total <= device_mem - hw.device_overhead_bytes,
        device_overhead_bytes=hw.device_overhead_bytes,
        usable_memory_bytes=device_mem - hw.device_overhead_bytes,
        flops_per_step=float(flops_per_step),
        bubble_fraction=bubble,
        step_time_s=step,
        mfu=mfu,
        device_peak_flops=peak,
        engine=engine,
        precision=t.precision,
        samples_per_s=t.global_batch_size / step if step else 0.0,
        tokens_per_s=t.global_batch_size * tokens / step if step else 0.0,
        comm_bytes_per_step={k: int(v) for k, v in comm.items()},
        time_s={
            "compute": compute,
            "host_ops": host_time[stage_time.index(compute)],
            "elementwise": elementwise_time[stage_time.index(compute)],
            "grad_accumulate": accumulate_time[stage_time.index(compute)],
            "bubble": pipelined_compute - compute,
            **{f"comm_{k}": v for k, v in comm_time.items()},
            "comm_hidden": hidden,
            "update": update,
            "offload": offload,
        },
        stages=stages,
        notes=notes,
    )


def _overlap_window(engine: str, layout: Layout, n: int, compute: float) -> float:
    """Compute time a step's data-parallel communication can hide behind, per engine.

    - DDP / ZeRO-1 under gradient accumulation (`no_sync`): the buckets are all-reduced during the
      last micro-batch's backward only, 2/3 of one micro-batch's compute (backward = 2 × forward).
    - FSDP under a pipeline schedule gathers once before the first micro-batch's forward and
      reduce-scatters after the last one's backward: one micro-batch's compute in all.
    - FSDP without a pipeline gathers and reduce-scatters every unit in every micro-batch, prefetched
      behind the unit before it: the whole compute.
    `compute` is the step's compute on the slowest stage (all its micro-batches)."""
    per_micro = compute / max(1, n)
    if engine == "ddp":
        return (2 / 3) * per_micro
    if engine == "zero1":  # its reduce-scatter and all-gather run after the backward, not behind it
        return 0.0
    if engine == "fsdp" and layout.pp > 1:
        return per_micro
    return compute


def _offload_time(cfg: RunConfig, engine: str, p: float, sharding: int, n: int) -> float:
    """Offloaded FSDP (CPUOffloadPolicy): each rank's parameter shard crosses to the device for every
    all-gather and its gradient shard back after every reduce-scatter (fp32, over the host link),
    and the optimizer step runs on the host. Not overlapped: FSDP2 copies on the compute stream."""
    s, hw = cfg.strategy, cfg.hardware
    if not (s.offload and engine == "fsdp" and hw.device_type == "cuda"):
        return 0.0
    shard = p / sharding
    pipelined = Layout.of(cfg).pp > 1
    gathers = 1 if pipelined else (n if not reshard_after_forward(s.sharding_stage) else 2 * n)
    scatters = 1 if pipelined else n
    link = (FP32 * shard * (gathers + scatters)) / (hw.host_link_gbps * 1e9) if hw.host_link_gbps else 0.0
    return link + shard * hw.offload_update_ns_per_param * 1e-9


def _bandwidth(cfg: RunConfig, layout: Layout, dim: str) -> float:
    hw = cfg.hardware
    crosses = layout.span(dim) > hw.devices_per_node and hw.nodes > 1
    return (hw.inter_node_gbps if crosses else hw.intra_node_gbps) * 1e9


def _latency(cfg: RunConfig, layout: Layout, dim: str) -> float:
    """Seconds of fixed cost per collective call of a mesh dim: hardware.inter_node_latency_us when
    its groups span nodes (and it is set), else comm_latency_us."""
    hw = cfg.hardware
    crosses = layout.span(dim) > hw.devices_per_node and hw.nodes > 1
    if crosses and hw.inter_node_latency_us is not None:
        return hw.inter_node_latency_us * 1e-6
    return hw.comm_latency_us * 1e-6


def _fsdp_collectives(s: CollectiveStrategy, layout: Layout, n: int) -> tuple[int, int]:
    """All-gathers and reduce-scatters of each FSDP unit per step. Under a pipeline FSDP gathers
    once before the first micro-batch and reduce-scatters once after the last; without one every
    micro-batch gathers (twice under ZeRO-3: again for its backward) and reduce-scatters."""
    if layout.pp > 1:
        return 1, 1
    return (2 if reshard_after_forward(s.sharding_stage) else 1) * n, n


def _comm(
    cfg: RunConfig,
    layout: Layout,
    chunks: list[list[Unit]],
    ranks: list[int],
    p: float,
    n: int,
    engine: str,
    data_parallel_only: bool = False,
) -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
    """Bytes one device sends per step, collective calls, and the bytes' cost in all-reduce bytes
    (what moves at the profile's all-reduce bandwidth in the same time), per mesh dimension (worst pp
    rank). The cost differs from the bytes where the backend's reduce-scatter or all-gather is
    slower than its all-reduce per byte of ring volume (`reduce_scatter_gbps`, `all_gather_gbps`:
    gloo's reduce-scatter costs more than its all-reduce of the same buffer; NCCL's do not differ)."""
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    b = cfg.train.micro_batch_size
    act, residual = _act_bytes(cfg.train.precision, engine, family_of(cfg.model).convolutional)
    gather = 2 if cfg.train.precision != "fp32" else FP32
    dp, sh, mp, pp = layout.dp, layout.sharding, layout.mp, layout.pp
    vol = {"dp": 0.0, "sharding": 0.0, "mp": 0.0, "pp": 0.0}
    calls = {"dp": 0, "sharding": 0, "mp": 0, "pp": 0}
    grad_bytes = FP32 * p
    hw = cfg.hardware
    rs = hw.intra_node_gbps / (hw.reduce_scatter_gbps or hw.intra_node_gbps)  # per byte, vs all-reduce
    ag = hw.intra_node_gbps / (hw.all_gather_gbps or hw.intra_node_gbps)
    cost = {"sharding": 0.0}
    # data_parallel_only (_stage_comm, once per stage: it counts mp and pp itself): the bytes of
    # dp and sharding, which need no units; their calls are not asked for
    worst_units: list[Unit] = []
    if not data_parallel_only:
        units_per_rank: list[list[Unit]] = [[] for _ in range(pp)]  # one pass (a search plans thousands)
        for c, r in enumerate(ranks):
            units_per_rank[r].extend(chunks[c])
        worst_units = max(units_per_rank, key=lambda us: sum(u.params for u in us))
    n_units = max(1, len(worst_units))

    if engine == "ddp":
        vol["dp"] = 2 * (dp - 1) / dp * grad_bytes  # one all-reduce per step (no_sync while accumulating)
        calls["dp"] = 1
    elif engine == "zero1":
        # per bucket: reduce-scatter of the fp32 gradients, all-gather of the updated working
        # weights (16-bit under mixed precision), all-reduce of the gradient shard across dp
        buckets = max(1, math.ceil(p / ZERO1_BUCKET_ELEMENTS))
        if hw.backend == "gloo":  # all-reduces instead: gloo's reduce-scatter and all-gather are slower
            vol["sharding"] = cost["sharding"] = 2 * (sh - 1) / sh * (grad_bytes + gather * p)
        else:
            vol["sharding"] = (sh - 1) / sh * (grad_bytes + gather * p)
            cost["sharding"] = (sh - 1) / sh * (rs * grad_bytes + ag * gather * p)
        # + the all-reduce of the gradient chunks' squared norm (runtime/optim.py: zero_grad_norm)
        calls["sharding"] = 2 * buckets + 1 if sh > 1 else 0
        vol["dp"] = 2 * (dp - 1) / dp * grad_bytes / sh
        calls["dp"] = buckets if dp > 1 else 0
    elif engine == "fsdp":
        gathers_per_step, scatters = _fsdp_collectives(s, layout, n)
        vol["sharding"] = (sh - 1) / sh * (gathers_per_step * gather * p + scatters * grad_bytes)
        cost["sharding"] = (sh - 1) / sh * (ag * gathers_per_step * gather * p + rs * scatters * grad_bytes)
        # + the gradient norm's all-reduce of the shards' squared norms (DTensor's full_tensor)
        calls["sharding"] = (gathers_per_step + scatters) * n_units + 1 if sh > 1 else 0
        vol["dp"] = 2 * (dp - 1) / dp * grad_bytes / sh  # HSDP: all-reduce of the shards across replicas
        calls["dp"] = n_units if dp > 1 else 0
    if data_parallel_only:
        return vol, calls, {dim: cost.get(dim, v) for dim, v in vol.items()}
    if mp > 1:
        again = block_recomputes(s.schedule, pp, chunks)
        vol["mp"], calls["mp"] = _mp_comm(cfg, layout, worst_units, n, engine, again)
    if pp > 1:
        local_chunks = max(1, len(chunks) // pp)
        boundary = max((u.boundary_elements for u in worst_units), default=0.0)
        # activations forward, gradients back (under sequence parallelism: the sequence shard)
        vol["pp"] = n * local_chunks * 2 * b * boundary * residual / (mp if s.sequence_parallel else 1)
        calls["pp"] = n * local_chunks * 2
    return vol, calls, {dim: cost.get(dim, v) for dim, v in vol.items()}


# --------------------------------------------------------------------------------------------------
# Parameter-server plan


def expected_unique(num_rows: int, draws: int, alpha: float) -> float:
    """Expected distinct ids among `draws` samples of a Zipf(alpha) law over `num_rows` ids:
    sum_i 1 - (1 - p_i)^draws."""
    import numpy as np

    if num_rows <= EXACT_ROWS:
        ranks = np.arange(1, num_rows + 1, dtype=np.float64)
        p = ranks**-alpha
        p /= p.sum()
        return float(np.sum(-np.expm1(draws * np.log1p(-p))))
    # A 10^9-row table would need 7.45 GiB of ranks: the head exactly, the tail in narrow
    # geometric bins (ratio ~1.001 over 10^12 rows) with the probability at each bin's midpoint.
    head = np.arange(1, EXACT_ROWS + 1, dtype=np.float64)
    edges = np.unique(np.geomspace(EXACT_ROWS + 1, num_rows + 1, TAIL_BINS).round())
    counts = np.diff(edges)
    mids = (edges[:-1] + edges[1:] - 1) / 2
    weight_head, weight_tail = head**-alpha, counts * mids**-alpha
    total = weight_head.sum() + weight_tail.sum()
    p_head, p_tail = weight_head / total, mids**-alpha / total
    return float(
        np.sum(-np.expm1(draws * np.log1p(-p_head))) + np.sum(counts * -np.expm1(draws * np.log1p(-p_tail)))
    )


EXACT_ROWS = 1 << 16  # rows summed one by one; beyond, TAIL_BINS bins (a few ms per table)
TAIL_BINS = 20_000


def _ps_plan(cfg: RunConfig) -> Plan:
    s = cfg.strategy
    assert isinstance(s, PSStrategy)
    m, t, hw = cfg.model, cfg.train, cfg.hardware
    units = model_units(m)
    params = sum(u.params for u in units)
    k = optimizer_state_factor(cfg.optim.name, cfg.optim.momentum)
    sparse_k = 1 if s.sparse_optimizer == "adagrad" else 0
    n = t.accumulate_steps or 1
    b = t.micro_batch_size

    # A trainer prefetches once per step the distinct rows of all its n micro-batches (parameters
    # do not change within a step), so the draws per table are b·n, de-duplicated.
    family = family_of(m)
    sparse_rows = 0
    pulled_rows = 0.0
    row_width = 0
    if family.sparse_tables is not None:
        row_width = family.sparse_row_width(m)
        for table in family.sparse_tables(m):
            if table.distributed:
                sparse_rows += table.num_embeddings
                pulled_rows += expected_unique(table.num_embeddings, b * n, cfg.data.zipf_alpha)
    sparse_params = sparse_rows * row_width
    dense_params = params - sparse_params
    if family.parameter_shapes is not None:
        # exact bytes of each server's shard, following the dispatch and slicing rules
        place = ps_placement(cfg)
        per_server = [place.server_bytes(i) for i in range(s.num_servers)]
    else:
        even = (FP32 * dense_params * (1 + k) + FP32 * sparse_params * (1 + sparse_k)) / s.num_servers
        per_server = [int(even)] * s.num_servers
    server_bytes = max(per_server)
    acts = sum(u.saved("none").total for u in units) * b * FP32
    inputs = n * b * family_of(m).input_bytes(m)  # a trainer loads all its micro-batches of the step
    trainer_bytes = FP32 * dense_params * 2 + FP32 * pulled_rows * row_width * 2 + acts + inputs
    # per trainer per step: values pulled; gradients pushed with their row ids (int64), the ids also
    # sent once with the prefetch request
    pull = FP32 * (dense_params + pulled_rows * row_width)
    push = FP32 * (dense_params + pulled_rows * row_width) + 2 * 8 * pulled_rows
    flops_per_step = t.global_batch_size * 3 * sum(u.fwd_flops for u in units)
    peak = hw.peak_flops(t.precision)
    compute = n * b * 3 * sum(u.fwd_flops for u in units) / (peak * hw.matmul_efficiency)
    # two round trips per step, to all servers in parallel: async pull + push; sync push (stage)
    # + commit, whose reply prefetches the next step's values
    comm_time = (pull + push) / (hw.intra_node_gbps * 1e9) + 2 * hw.comm_latency_us * 1e-6
    step = compute + comm_time
    world = s.num_servers + s.num_trainers
    worst = max(server_bytes, trainer_bytes)
    mem = Memory(
        params=FP32 * dense_params,
        grads=FP32 * dense_params,
        optimizer=0.0,
        activations=acts + FP32 * pulled_rows * row_width * 2,
        inputs=inputs,
        total=worst,
    )
    if server_bytes >= trainer_bytes:
        mem.peak = {"phase": "the fullest server", "parts": {"server_shard": server_bytes}}
    else:
        parts = {"params": mem.params, "grads": mem.grads, "activations": mem.activations, "inputs": inputs}
        mem.peak = {"phase": "a trainer", "parts": parts}
    return Plan(
        world_size=world,
        mesh={"pp": 1, "dp": s.num_trainers, "sharding": 1, "mp": 1},
        params=int(params),
        batch={
            "global_batch_size": t.global_batch_size,
            "micro_batch_size": b,
            "accumulate_steps": n,
            "num_microbatches": n,
        },
        memory_bytes=mem.as_ints(),
        memory_peak=mem.peak_ints(),
        device_memory_bytes=hw.memory_per_device_bytes,
        fits=worst <= hw.memory_per_device_bytes - hw.device_overhead_bytes,
        device_overhead_bytes=hw.device_overhead_bytes,
        usable_memory_bytes=hw.memory_per_device_bytes - hw.device_overhead_bytes,
        flops_per_step=float(flops_per_step),
        bubble_fraction=0.0,
        step_time_s=step,
        mfu=flops_per_step / (step * s.num_trainers * peak) if step else 0.0,
        device_peak_flops=peak,
        engine="ps",
        precision=t.precision,
        samples_per_s=t.global_batch_size / step if step else 0.0,
        comm_bytes_per_step={"pull": int(pull), "push": int(push)},
        time_s={"compute": compute, "comm_ps": comm_time},
        ps={
            "num_servers": s.num_servers,
            "num_trainers": s.num_trainers,
            "dense_params": int(dense_params),
            "sparse_rows": int(sparse_rows),
            "sparse_params": int(sparse_params),
            "server_bytes": int(server_bytes),
            "server_bytes_per_server": per_server,
            "trainer_bytes": int(trainer_bytes),
            "rows_pulled_per_step": pulled_rows,
            "sparse_bytes_pulled_per_step": int(FP32 * pulled_rows * row_width),
            "sparse_table_bytes": int(FP32 * sparse_params),
        },
    )


def make_plan(cfg: RunConfig, memory: RankMemory | None = None, per_stage: bool = True) -> Plan:
    """Plan a resolved, valid config. `memory`: `rank_memory(cfg)` of this same config, when the
    caller has it already (a layout search asks it first). `per_stage=False`: without
    `plan.stages` (each pipeline stage's memory, FLOPs and traffic; a search ranks layouts by the
    rest), so the ranks that cannot hold the most memory are not planned; all else is the same."""
    if isinstance(cfg.strategy, PSStrategy):
        return _ps_plan(cfg)
    return _collective_plan(cfg, memory, per_stage)
