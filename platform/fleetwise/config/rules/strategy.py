"""Rules of the `strategy` section: degrees, tensor and pipeline parallelism, sharding, the parameter server."""

from __future__ import annotations

from collections.abc import Iterator

from fleetwise.config.layout import Layout
from fleetwise.config.problems import Problem
from fleetwise.config.rules.context import Context, num_microbatches, rule
from fleetwise.config.strategy import DEGREE_NAMES, INTERLEAVED_SCHEDULES, PSStrategy
from fleetwise.families import family_of


@rule
def preset_degrees(ctx: Context) -> Iterator[Problem]:
    s = ctx.collective
    if s is None or s.name == "hybrid":
        return
    for name in DEGREE_NAMES:
        v = s.degree(name)
        if name not in s.free_degrees and v != 1:
            yield Problem(
                f"strategy.{name}",
                f"strategy '{s.name}' keeps {name} at 1 (it may vary only {', '.join(s.free_degrees)}); got {v}",
                f"use strategy=hybrid to combine parallelisms, or set strategy.{name}=1",
            )


@rule
def layout_product(ctx: Context) -> Iterator[Problem]:
    s = ctx.collective
    if s is not None:
        yield from Layout.resolve(s, ctx.cfg.hardware.world_size)[1]


@rule
def tensor_parallel_divides(ctx: Context) -> Iterator[Problem]:
    m, lay = ctx.cfg.model, ctx.layout
    if lay is None or not lay.mp_enabled:
        return
    fam = family_of(m)
    if fam.tensor_parallel is None:
        why, fix = fam.no_tensor_parallel
        yield Problem(
            "strategy.mp_degree",
            f"model family '{m.family}' has no tensor-parallel plan (mp_degree={lay.mp}): {why}",
            fix,
        )
        return
    yield from fam.tensor_parallel(m, lay.mp)


@rule
def pipeline_split(ctx: Context) -> Iterator[Problem]:
    s, lay, m = ctx.collective, ctx.layout, ctx.cfg.model
    if s is None:
        return
    pp = lay.pp if lay else (s.pp_degree if isinstance(s.pp_degree, int) else None)
    if pp is None:
        return
    no_pipeline = family_of(m).pipeline_refusal(m)
    if no_pipeline is not None and pp > 1:
        why, fix = no_pipeline
        yield Problem("strategy.pp_degree", f"pp_degree={pp} on {why}", fix)
        return
    units = m.num_layers
    v = s.virtual_stages
    if v > 1 and pp == 1:
        yield Problem(
            "strategy.virtual_stages",
            f"virtual_stages={v} needs pipeline parallelism (pp_degree=1)",
            "set strategy.virtual_stages=1, or raise strategy.pp_degree",
        )
        return
    stages = pp * v
    if units is None:  # a model not imported (`validate` of a recipe from elsewhere): nothing to count
        return
    if stages > units and stages > 1:  # one stage runs any model, blocks or none
        yield Problem(
            "strategy.pp_degree",
            f"pp_degree({pp}) × virtual_stages({v}) = {stages} stages but the model has {units} layers",
            f"use at most {units} stages: lower strategy.pp_degree or strategy.virtual_stages",
        )
        return
    if s.layer_split is not None:
        if pp == 1:
            yield Problem(
                "strategy.layer_split", "layer_split given but pp_degree=1", "remove strategy.layer_split"
            )
        elif len(s.layer_split) != stages:
            yield Problem(
                "strategy.layer_split",
                f"layer_split has {len(s.layer_split)} entries but pp_degree({pp}) × virtual_stages({v}) = {stages}",
                f"give exactly {stages} layer counts",
            )
        elif sum(s.layer_split) != units:
            yield Problem(
                "strategy.layer_split",
                f"layer_split {s.layer_split} sums to {sum(s.layer_split)} but the model has {units} layers",
                f"make the counts add up to {units}",
            )
    elif pp > 1 and units % stages:
        base, extra = divmod(units, stages)
        split = [base + (1 if i < extra else 0) for i in range(stages)]
        yield Problem(
            "strategy.pp_degree",
            f"{units} layers do not split evenly into pp_degree({pp}) × virtual_stages({v}) = {stages} stages",
            # the override must be one shell word: the list without spaces, the sentence with them
            f"choose a stage count dividing {units}, or set strategy.layer_split=[{','.join(map(str, split))}]",
        )


@rule
def pipeline_schedule(ctx: Context) -> Iterator[Problem]:
    s, lay = ctx.collective, ctx.layout
    if s is None or lay is None or not lay.pp_enabled:
        return
    interleaved = s.schedule in INTERLEAVED_SCHEDULES
    if interleaved and s.virtual_stages < 2:
        yield Problem(
            "strategy.virtual_stages",
            f"schedule {s.schedule} runs several model chunks per rank; virtual_stages={s.virtual_stages}",
            "set strategy.virtual_stages=2 (or more), or use schedule=1F1B",
        )
    if not interleaved and s.virtual_stages > 1:
        yield Problem(
            "strategy.schedule",
            f"schedule {s.schedule} runs one chunk per rank but virtual_stages={s.virtual_stages}",
            "use strategy.schedule=interleaved_1F1B, or set strategy.virtual_stages=1",
        )
    if s.schedule == "ZBV_zero_bubble" and s.virtual_stages != 2:
        yield Problem(
            "strategy.virtual_stages",
            f"ZBV_zero_bubble places exactly 2 chunks per rank (V shape); virtual_stages={s.virtual_stages}",
            "set strategy.virtual_stages=2",
        )
    n = num_microbatches(ctx.cfg, lay)
    if n is None:
        return
    if interleaved and n % lay.pp:
        yield Problem(
            "train.accumulate_steps",
            f"schedule {s.schedule} needs micro-batches ({n}) divisible by pp_degree ({lay.pp})",
            f"make train.global_batch_size / (micro_batch_size × dp × sharding) a multiple of {lay.pp}",
        )
    if n < lay.pp:
        yield Problem(
            "train.accumulate_steps",
            f"{n} micro-batches per step cannot fill {lay.pp} pipeline stages (bubble > 50%)",
            f"raise train.global_batch_size or lower train.micro_batch_size so that accumulate_steps >= {lay.pp}",
        )


@rule
def sharding_options(ctx: Context) -> Iterator[Problem]:
    s, lay = ctx.collective, ctx.layout
    if s is None:
        return
    sh = lay.sharding if lay else s.sharding_degree
    cp = lay.cp if lay else s.cp_degree
    # cp ranks share parameter shards like sharding ones (FSDP over sharding × cp): with cp > 1 a
    # stage shards over cp even at sharding_degree 1 (stage 1 with cp: config/rules/context_parallel.py)
    if s.sharding_stage is not None and sh == 1 and cp == 1:
        yield Problem(
            "strategy.sharding_stage",
            f"sharding_stage={s.sharding_stage} but sharding_degree=1: nothing to shard over",
            "set strategy.sharding_degree > 1 (or auto), or strategy.sharding_stage=null",
        )
    if isinstance(sh, int) and sh > 1 and s.sharding_stage is None:
        yield Problem(
            "strategy.sharding_stage",
            f"sharding_degree={sh} needs a ZeRO stage",
            "set strategy.sharding_stage=1 (optimizer state), 2 (+ gradients) or 3 (+ parameters)",
        )
    if s.offload and sh == 1:
        yield Problem(
            "strategy.offload",
            "offload moves sharded state to host memory, but sharding_degree=1",
            "set strategy.sharding_degree > 1 with sharding_stage 2 or 3, or strategy.offload=false",
        )
    if s.offload and s.sharding_stage == 1:
        yield Problem(
            "strategy.offload",
            "offload is implemented by FSDP (sharding_stage 2 or 3), not stage 1",
            "set strategy.sharding_stage=2 or 3",
        )


@rule
def sequence_parallel(ctx: Context) -> Iterator[Problem]:
    s, lay = ctx.collective, ctx.layout
    if s is None or not s.sequence_parallel:
        return
    if lay is not None and not lay.mp_enabled:
        yield Problem(
            "strategy.sequence_parallel",
            "sequence_parallel splits activations over mp ranks; mp_degree=1",
            "set strategy.mp_degree > 1, or strategy.sequence_parallel=false",
        )
    m = ctx.cfg.model
    tokens = family_of(m).tokens_per_sample(m)
    if tokens and lay is not None and tokens % lay.mp:
        yield Problem(
            "strategy.sequence_parallel",
            f"model.seq_len={tokens} does not divide by mp_degree={lay.mp}",
            "choose a seq_len divisible by mp_degree, or strategy.sequence_parallel=false",
        )


@rule
def recompute_supported(ctx: Context) -> Iterator[Problem]:
    s = ctx.collective
    no_recompute = family_of(ctx.cfg.model).recompute_refusal(ctx.cfg.model)
    if s is not None and s.recompute != "none" and no_recompute is not None:
        why, fix = no_recompute
        yield Problem("strategy.recompute", why, fix)


# --- parameter server ------------------------------------------------------------------------------


@rule
def parameter_server(ctx: Context) -> Iterator[Problem]:
    s, m = ctx.cfg.strategy, ctx.cfg.model
    if not isinstance(s, PSStrategy):
        return
    refusal = family_of(m).no_parameter_server
    if refusal is not None:
        yield Problem("strategy", f"strategy=ps: {refusal[0]}", refusal[1])
        return
    tables = family_of(m).sparse_tables
    distributed = tables is not None and any(t.distributed for t in tables(m))
    if not distributed and not s.dense_fallback:
        what = (
            "its sparse tables are all distributed=false"
            if tables is not None
            else f"model family '{m.family}' has no sparse embedding tables"
        )
        yield Problem(
            "strategy.dense_fallback",
            f"strategy=ps serves distributed sparse tables, but {what}",
            "set strategy.dense_fallback=true to keep dense parameters on the servers, or use a collective strategy",
        )
    if s.max_staleness is not None and s.mode == "sync":
        yield Problem(
            "strategy.max_staleness",
            "max_staleness bounds async trainers; mode=sync never runs ahead",
            "set strategy.mode=async, or strategy.max_staleness=null",
        )
    if ctx.launching and tables is None:  # the ps runtime trains the families with sparse tables
        yield Problem(
            "strategy",
            f"the parameter-server runtime trains CTR models; model family '{m.family}' can be planned "
            "with strategy=ps but not trained with it",
            "train it with strategy=dp or strategy=sharding (use `fleetwise plan` to compare with ps)",
        )
    if ctx.launching and ctx.cfg.fault.on_nonfinite == "skip":
        yield Problem(
            "fault.on_nonfinite",
            "on_nonfinite=skip: parameter-server trainers abort on a non-finite gradient (skipping "
            "would need every trainer and server to agree to drop the step)",
            "set fault.on_nonfinite=abort",
        )
    if ctx.launching and ctx.cfg.checkpoint.resume != "none":
        yield Problem(
            "checkpoint.resume",
            f"resume={ctx.cfg.checkpoint.resume!r}: the parameter-server runtime writes server shards "
            "(run_dir/ps/server_<i>.pt) but cannot resume from them yet",
            "set checkpoint.resume=none",
        )
    if ctx.launching and ctx.cfg.hardware.device_type != "cpu":
        yield Problem(
            "hardware",
            f"the parameter-server runtime runs trainers and servers as CPU processes; "
            f"hardware '{ctx.cfg.hardware.name}' is {ctx.cfg.hardware.device_type}",
            "use hardware=cpu for strategy=ps (`fleetwise plan` still estimates it on GPUs)",
        )
    if ctx.cfg.hardware.device_type == "cuda" and s.num_trainers > ctx.cfg.hardware.world_size:
        yield Problem(
            "strategy.num_trainers",
            f"{s.num_trainers} trainers but the hardware has {ctx.cfg.hardware.world_size} devices",
            f"set strategy.num_trainers <= {ctx.cfg.hardware.world_size}",
        )
