"""Validation: turn a composed config into a resolved `RunConfig`, or list every problem at once.

Two passes. First pydantic parses the raw dict (types, ranges, unknown keys). Then the rules
below check how sections fit together (degrees × world size, divisibility, batch arithmetic,
what a model family supports). Each rule yields `Problem`s naming the config path, the values
and a fix; all of them run, so a user sees every mistake in one go. Finally `resolve` fills the
derived values (an `auto` degree, `train.accumulate_steps`) so workers see concrete numbers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from fleetwise.config.layout import Layout
from fleetwise.config.model import (
    VOCAB_MULTIPLE,
    CTRModel,
    ERNIEModel,
    ResNetModel,
    TransformerModel,
    padded_vocab,
)
from fleetwise.config.problems import ConfigError, Problem, did_you_mean
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import DEGREE_NAMES, INTERLEAVED_SCHEDULES, CollectiveStrategy, PSStrategy

# ---------------------------------------------------------------------------------------------
# Pass 1: pydantic


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at `loc` (for 'did you mean')."""

    cls: Any = RunConfig
    for part in loc[:-1]:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return None
        ann = cls.model_fields[part].annotation
        candidates = [a for a in _flatten_union(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
        cls = candidates[0] if len(candidates) == 1 else None
        if cls is None:
            return None
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _flatten_union(ann: Any) -> list[Any]:
    from typing import get_args

    args = get_args(ann)
    if not args:
        return [ann]
    out: list[Any] = []
    for a in args:
        out.extend(_flatten_union(a))
    return out


_TAG_PARTS = re.compile(
    r"^(int|float|str|bool|none|list\[.*\]|literal\[.*\]|function-.*|constrained-.*|tagged-union\[.*\])$"
)


def _clean_loc(raw_loc: tuple[Any, ...], data: dict[str, Any]) -> tuple[Any, ...]:
    """Drop pydantic's union/tag markers: ('strategy','dp','dp_degree','int') -> ('strategy','dp_degree')."""
    loc: list[Any] = []
    for i, part in enumerate(raw_loc):
        if isinstance(part, str) and _TAG_PARTS.match(part):
            continue
        # Discriminated unions insert the tag value right after the section name.
        if i == 1 and raw_loc[0] in ("strategy", "model") and isinstance(data.get(raw_loc[0]), dict):
            tag_key = "name" if raw_loc[0] == "strategy" else "family"
            if data[raw_loc[0]].get(tag_key) == part:
                continue
        loc.append(part)
    return tuple(loc)


def _pydantic_problems(err: ValidationError, data: dict[str, Any]) -> list[Problem]:
    grouped: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for e in err.errors(include_url=False):
        grouped.setdefault(_clean_loc(e["loc"], data), []).append(e)
    problems = []
    for loc, errs in grouped.items():
        path = ".".join(str(p) for p in loc)
        first = errs[0]
        value = first.get("input")
        if first["type"] == "extra_forbidden":
            owner = _model_at(loc)
            known = sorted(owner.model_fields) if owner else []
            problems.append(
                Problem(
                    path,
                    f"unknown key '{loc[-1]}'.{did_you_mean(str(loc[-1]), known)}",
                    f"remove it; valid keys here: {', '.join(known)}" if known else "remove it",
                )
            )
        elif first["type"] == "missing":
            problems.append(
                Problem(path, "required key is missing", f"set {path}=<value> (add it to the recipe)")
            )
        elif first["type"] == "union_tag_invalid":
            expected = first.get("ctx", {}).get("expected_tags", "")
            problems.append(
                Problem(path, f"unknown option {first['ctx'].get('tag')!r}", f"choose one of {expected}")
            )
        else:
            msgs = "; or ".join(dict.fromkeys(e["msg"] for e in errs))
            problems.append(Problem(path, f"invalid value {value!r}: {msgs}", _type_hint(path, errs)))
    return problems


def _type_hint(path: str, errs: list[dict[str, Any]]) -> str:
    if path.startswith("strategy.") and path.endswith("_degree"):
        return f"set {path} to a positive integer or 'auto'"
    for e in errs:
        if e["type"] == "literal_error":
            return f"set {path} to one of {e['ctx']['expected']}"
        if e["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            return f"set {path} within the allowed range ({e['msg'].lower()})"
    return f"set {path} to a valid {errs[0]['type'].split('_')[0]} value"


def parse(data: dict[str, Any]) -> tuple[RunConfig | None, list[Problem]]:
    try:
        return RunConfig.model_validate(data), []
    except ValidationError as err:
        return None, _pydantic_problems(err, data)


# ---------------------------------------------------------------------------------------------
# Pass 2: rules across sections


@dataclass(frozen=True)
class Context:
    """What rules need beyond the config: the resolved layout when it could be derived."""

    cfg: RunConfig
    layout: Layout | None
    launching: bool = False  # rules about starting processes apply only to `train`

    @property
    def collective(self) -> CollectiveStrategy | None:
        s = self.cfg.strategy
        return None if isinstance(s, PSStrategy) else s


Rule = Callable[[Context], Iterator[Problem]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def num_microbatches(cfg: RunConfig, layout: Layout | None) -> int | None:
    """Micro-batches per step per data-parallel rank, given or derived from the batch triad."""
    t = cfg.train
    if t.accumulate_steps is not None:
        return t.accumulate_steps
    ranks = data_parallel_ranks(cfg, layout)
    if ranks is None:
        return None
    per_rank = t.micro_batch_size * ranks
    return t.global_batch_size // per_rank if t.global_batch_size % per_rank == 0 else None


def data_parallel_ranks(cfg: RunConfig, layout: Layout | None) -> int | None:
    if isinstance(cfg.strategy, PSStrategy):
        return cfg.strategy.num_trainers
    return layout.data_parallel_size if layout else None


# --- strategy -----------------------------------------------------------------------------------


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
    if not isinstance(m, TransformerModel):
        yield Problem(
            "strategy.mp_degree",
            f"model family '{m.family}' has no tensor-parallel plan (mp_degree={lay.mp}): "
            + (
                "convolutions are not split by fleetwise"
                if isinstance(m, ResNetModel)
                else "its embedding tables belong on parameter servers"
            ),
            "set strategy.mp_degree=1 and use dp or sharding"
            + ("" if isinstance(m, ResNetModel) else ", or strategy=ps"),
        )
        return
    padded = padded_vocab(m.vocab_size)
    if padded % lay.mp:
        yield Problem(
            "strategy.mp_degree",
            f"mp_degree={lay.mp} does not divide the padded vocabulary "
            f"({m.vocab_size} -> {padded}, a multiple of {VOCAB_MULTIPLE})",
            f"use an mp_degree dividing {padded}",
        )
    for key in ("num_attention_heads", "hidden_size", "ffn_hidden_size"):
        value = getattr(m, key)
        if value % lay.mp:
            divisors = [
                d for d in range(1, min(value, 64) + 1) if value % d == 0
            ]  # not up to value: 10^11 hangs
            yield Problem(
                "strategy.mp_degree",
                f"mp_degree={lay.mp} does not divide model.{key}={value}",
                f"use an mp_degree that divides {value} (e.g. {', '.join(map(str, divisors[-4:]))})",
            )


@rule
def pipeline_split(ctx: Context) -> Iterator[Problem]:
    s, lay, m = ctx.collective, ctx.layout, ctx.cfg.model
    if s is None:
        return
    pp = lay.pp if lay else (s.pp_degree if isinstance(s.pp_degree, int) else None)
    if pp is None:
        return
    if isinstance(m, CTRModel) and pp > 1:
        yield Problem(
            "strategy.pp_degree",
            f"pp_degree={pp} on a CTR model: its MLP is too shallow to pipeline",
            "set strategy.pp_degree=1; use strategy=ps for large embedding tables",
        )
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
    if stages > units:
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
            f"choose a stage count dividing {units}, or set strategy.layer_split={split}".replace(" ", ""),
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
    if s.sharding_stage is not None and sh == 1:
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
    if s.sharding_stage == 1 and lay is not None and (lay.mp_enabled or lay.pp_enabled):
        why = (
            f"cannot shard tensor-parallel parameters (mp_degree={lay.mp})"
            if lay.mp_enabled
            else f"rides on DDP, which cannot follow a pipeline schedule (pp_degree={lay.pp})"
        )
        yield Problem(
            "strategy.sharding_stage",
            f"sharding_stage=1 (DDP + ZeroRedundancyOptimizer) {why}",
            "use strategy.sharding_stage=2 (FSDP keeps parameters whole between forward and backward)",
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
    if isinstance(m, TransformerModel) and lay is not None and m.seq_len % lay.mp:
        yield Problem(
            "strategy.sequence_parallel",
            f"model.seq_len={m.seq_len} does not divide by mp_degree={lay.mp}",
            "choose a seq_len divisible by mp_degree, or strategy.sequence_parallel=false",
        )


@rule
def recompute_supported(ctx: Context) -> Iterator[Problem]:
    s = ctx.collective
    if s is not None and s.recompute != "none" and isinstance(ctx.cfg.model, CTRModel):
        yield Problem(
            "strategy.recompute",
            "a CTR model has no repeated blocks to recompute",
            "set strategy.recompute=none",
        )


# --- parameter server ------------------------------------------------------------------------------


@rule
def parameter_server(ctx: Context) -> Iterator[Problem]:
    s, m = ctx.cfg.strategy, ctx.cfg.model
    if not isinstance(s, PSStrategy):
        return
    distributed = isinstance(m, CTRModel) and any(t.distributed for t in m.sparse_tables)
    if not distributed and not s.dense_fallback:
        what = (
            "its sparse tables are all distributed=false"
            if isinstance(m, CTRModel)
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
    if ctx.launching and not isinstance(m, CTRModel):
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


@rule
def ctr_tables_unique(ctx: Context) -> Iterator[Problem]:
    m = ctx.cfg.model
    if isinstance(m, CTRModel):
        names = [t.name for t in m.sparse_tables]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            yield Problem(
                "model.sparse_tables",
                f"duplicate table names {dupes}",
                "give every sparse table a unique name",
            )


# --- model ---------------------------------------------------------------------------------------------


@rule
def transformer_shape(ctx: Context) -> Iterator[Problem]:
    m = ctx.cfg.model
    if not isinstance(m, TransformerModel):
        return
    if m.hidden_size % m.num_attention_heads:
        yield Problem(
            "model.hidden_size",
            f"hidden_size={m.hidden_size} does not divide by num_attention_heads={m.num_attention_heads}",
            "choose heads dividing the width (head_dim = hidden_size / num_attention_heads)",
        )
    if isinstance(m, ERNIEModel) and m.seq_len * m.mask_prob < 1:
        yield Problem(
            "model.mask_prob",
            f"seq_len({m.seq_len}) × mask_prob({m.mask_prob}) < 1: nothing to predict",
            "raise model.mask_prob or model.seq_len",
        )


@rule
def resnet_shape(ctx: Context) -> Iterator[Problem]:
    m = ctx.cfg.model
    if isinstance(m, ResNetModel):
        if m.image_size < 32:
            yield Problem(
                "model.image_size",
                f"image_size={m.image_size}: ResNet downsamples by 32",
                "use model.image_size >= 32",
            )
        if len(m.layers) != 4:
            yield Problem(
                "model.layers",
                f"{len(m.layers)} stages given; ResNet has 4 (e.g. [3, 4, 6, 3])",
                "give four block counts",
            )


# --- batch, precision, hardware -------------------------------------------------------------------------


@rule
def batch_triad(ctx: Context) -> Iterator[Problem]:
    t = ctx.cfg.train
    ranks = data_parallel_ranks(ctx.cfg, ctx.layout)
    if t.micro_batch_size > t.global_batch_size:
        yield Problem(
            "train.micro_batch_size",
            f"micro_batch_size={t.micro_batch_size} > global_batch_size={t.global_batch_size}",
            "lower train.micro_batch_size or raise train.global_batch_size",
        )
        return
    if ranks is None:
        return
    who = "num_trainers" if isinstance(ctx.cfg.strategy, PSStrategy) else "dp_degree × sharding_degree"
    if t.accumulate_steps is None:
        per = t.micro_batch_size * ranks
        if t.global_batch_size % per:
            lo = t.global_batch_size // per * per
            yield Problem(
                "train.global_batch_size",
                f"global_batch_size={t.global_batch_size} is not a multiple of micro_batch_size({t.micro_batch_size})"
                f" × {who}({ranks}) = {per}",
                f"set train.global_batch_size to a multiple of {per} (e.g. {max(lo, per)} or {lo + per})",
            )
    else:
        expect = t.micro_batch_size * t.accumulate_steps * ranks
        if expect != t.global_batch_size:
            yield Problem(
                "train.accumulate_steps",
                f"global_batch_size({t.global_batch_size}) != micro_batch_size({t.micro_batch_size}) × "
                f"accumulate_steps({t.accumulate_steps}) × {who}({ranks}) = {expect}",
                "remove train.accumulate_steps to derive it, or set train.global_batch_size=" + str(expect),
            )


@rule
def precision_supported(ctx: Context) -> Iterator[Problem]:
    p, hw = ctx.cfg.train.precision, ctx.cfg.hardware
    if p == "bf16" and not hw.has_bf16:
        why = (
            "has no bf16 units" if hw.device_type == "cuda" else "emulates bf16 (about 100× slower than fp32)"
        )
        yield Problem(
            "train.precision",
            f"precision=bf16 but hardware '{hw.name}' {why}",
            "use train.precision="
            + ("fp16" if hw.device_type == "cuda" else "fp32")
            + (", or hardware.has_bf16=true to force it" if hw.device_type == "cpu" else ""),
        )
    if p == "fp16" and hw.device_type == "cpu":
        yield Problem(
            "train.precision",
            f"precision=fp16 needs a GPU; hardware '{hw.name}' is a CPU",
            "use train.precision=fp32 on CPU",
        )


@rule
def backend_matches_device(ctx: Context) -> Iterator[Problem]:
    hw = ctx.cfg.hardware
    if hw.device_type == "cpu" and hw.backend == "nccl":
        yield Problem(
            "hardware.backend",
            "backend=nccl needs CUDA devices; device_type=cpu",
            "set hardware.backend=gloo",
        )


@rule
def data_source(ctx: Context) -> Iterator[Problem]:
    d, m = ctx.cfg.data, ctx.cfg.model
    if d.source == "synthetic":
        return
    wants = {"token_file": ("gpt", "ernie"), "image_folder": ("resnet",), "image_array": ("resnet",)}[
        d.source
    ]
    if m.family not in wants:
        yield Problem(
            "data.source",
            f"data.source={d.source} feeds {'/'.join(wants)} models, not {m.family}",
            "use data.source=synthetic or a reader for this model family",
        )
        return
    if not d.path:
        yield Problem("data.path", f"data.source={d.source} needs a path", "set data.path=/path/to/data")
        return
    from fleetwise.config.datafiles import check_data_file  # local: only file-backed configs pay for it

    yield from check_data_file(d.source, Path(d.path), m)


@rule
def optimizer_schedule(ctx: Context) -> Iterator[Problem]:
    o, t = ctx.cfg.optim, ctx.cfg.train
    if o.warmup_steps > t.steps:
        yield Problem(
            "optim.warmup_steps",
            f"warmup_steps={o.warmup_steps} > train.steps={t.steps}",
            f"set optim.warmup_steps <= {t.steps}",
        )
    b1, b2 = o.betas
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        yield Problem(
            "optim.betas", f"betas={list(o.betas)} must lie in [0, 1)", "e.g. optim.betas=[0.9,0.95]"
        )


# --- launch, faults ---------------------------------------------------------------------------------------


_NNODES = re.compile(r"^(\d+)(?::(\d+))?$")


@rule
def launch_topology(ctx: Context) -> Iterator[Problem]:
    launch, hw = ctx.cfg.launch, ctx.cfg.hardware
    match = _NNODES.match(launch.nnodes)
    if not match:
        yield Problem(
            "launch.nnodes", f"nnodes={launch.nnodes!r} is not N or MIN:MAX", "e.g. launch.nnodes=2"
        )
        return
    lo = int(match.group(1))
    hi = int(match.group(2) or lo)
    if not 1 <= lo <= hi:
        yield Problem(
            "launch.nnodes", f"nnodes={launch.nnodes}: need 1 <= MIN <= MAX", "e.g. launch.nnodes=1:2"
        )
    if hi != hw.nodes:
        yield Problem(
            "launch.nnodes",
            f"launch.nnodes={launch.nnodes} but hardware.nodes={hw.nodes}",
            f"set hardware.nodes={hi} (the layout is planned for the largest node count)",
        )
    if launch.node_rank >= hi:
        yield Problem(
            "launch.node_rank",
            f"node_rank={launch.node_rank} but only {hi} nodes",
            f"use a node_rank in 0..{hi - 1}",
        )
    host, _, port = launch.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        yield Problem(
            "launch.rdzv_endpoint",
            f"rdzv_endpoint={launch.rdzv_endpoint!r} is not host:port",
            "e.g. launch.rdzv_endpoint=10.0.0.1:29500",
        )
    elif hi > 1 and int(port) == 0 and ctx.launching:
        yield Problem(
            "launch.rdzv_endpoint",
            "a multi-node job needs a fixed rendezvous port (got 0)",
            "set launch.rdzv_endpoint=<node0-host>:29500 on every node",
        )


def node_range(nnodes: str) -> tuple[int, int]:
    lo, _, hi = nnodes.partition(":")
    return int(lo), int(hi or lo)


@rule
def elastic_nodes(ctx: Context) -> Iterator[Problem]:
    """Elastic jobs (launch.nnodes=MIN:MAX) grow and shrink the data-parallel dimension: every node
    count in the range must still give a valid layout and batch split."""
    s, cfg = ctx.collective, ctx.cfg
    if not _NNODES.match(cfg.launch.nnodes):
        return
    lo, hi = node_range(cfg.launch.nnodes)
    if lo == hi:
        return
    if s is None:
        yield Problem(
            "launch.nnodes",
            "elastic node counts are for collective strategies, not ps",
            f"set launch.nnodes={hi}",
        )
        return
    if ctx.layout is None or lo < 1 or lo > hi:
        return
    for n in range(lo, hi + 1):
        try:
            elastic_config(cfg, n * cfg.hardware.devices_per_node)
        except ConfigError as err:
            yield Problem(
                "launch.nnodes",
                f"with {n} node(s): {err.problems[0].msg}",
                "choose degrees and a global batch that every node count in the range divides "
                "(only dp_degree changes with the node count)",
            )
            return


def elastic_config(cfg: RunConfig, world_size: int) -> RunConfig:
    """The config for an elastic job that started with `world_size` ranks: data parallelism absorbs
    the change (pp, sharding and mp stay as planned), accumulation is derived again."""
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    per_node = cfg.hardware.devices_per_node
    if world_size % per_node:
        raise ConfigError(
            [
                Problem(
                    "hardware.devices_per_node",
                    f"{world_size} ranks are not whole nodes of {per_node}",
                    "start every node with the same devices_per_node",
                )
            ]
        )
    hardware = cfg.hardware.model_copy(update={"nodes": world_size // per_node})
    strategy = s.model_copy(update={"dp_degree": "auto"})
    train = cfg.train.model_copy(update={"accumulate_steps": None})
    candidate = cfg.model_copy(
        update={
            "hardware": hardware,
            "strategy": strategy,
            "train": train,
            "launch": cfg.launch.model_copy(update={"nnodes": str(hardware.nodes)}),
        }
    )
    problems = [p for p in check(candidate) if p.loc != "launch.nnodes"]
    if problems:
        raise ConfigError(problems)
    return resolve(candidate)


@rule
def fault_hooks(ctx: Context) -> Iterator[Problem]:
    f = ctx.cfg.fault
    ws = (
        ctx.cfg.hardware.world_size
        if ctx.collective
        else ctx.cfg.strategy.num_servers + ctx.cfg.strategy.num_trainers
    )
    if f.kill_rank is not None and f.kill_rank >= ws:
        yield Problem(
            "fault.kill_rank", f"kill_rank={f.kill_rank} but world_size={ws}", f"use a rank in 0..{ws - 1}"
        )
    if (f.kill_rank is None) != (f.at_step is None):
        yield Problem(
            "fault.at_step", "fault.kill_rank and fault.at_step go together", "set both, or neither"
        )
    if f.at_step is not None and f.at_step > ctx.cfg.train.steps:
        yield Problem(
            "fault.at_step",
            f"at_step={f.at_step} > train.steps={ctx.cfg.train.steps}",
            "choose a step the run reaches",
        )


@rule
def checkpoint_options(ctx: Context) -> Iterator[Problem]:
    c = ctx.cfg.checkpoint
    if c.interval and not c.enabled:
        yield Problem(
            "checkpoint.interval",
            f"interval={c.interval} but checkpoint.enabled=false",
            "set checkpoint.enabled=true",
        )
    if c.resume == "auto" and not ctx.cfg.run.dir:
        yield Problem(
            "checkpoint.resume",
            "resume=auto continues a run directory, but run.dir is not set",
            "set run.dir=<the directory of the job to continue>",
        )
    if c.resume not in ("none", "auto") and not Path(c.resume).exists():
        yield Problem(
            "checkpoint.resume",
            f"checkpoint {c.resume!r} does not exist",
            "give an existing checkpoint directory, or checkpoint.resume=auto",
        )
    elif c.resume not in ("none", "auto") and not Path(c.resume).is_dir():
        yield Problem(
            "checkpoint.resume",
            f"{c.resume!r} is a file, not a checkpoint directory",
            "give a checkpoint directory (run_dir/checkpoints/step_N), or checkpoint.resume=auto",
        )


# ---------------------------------------------------------------------------------------------
# Entry points


def check(cfg: RunConfig, *, launching: bool = False) -> list[Problem]:
    from fleetwise.config import limits

    bounded = limits.problems(cfg)  # first: an absurd value must not reach a rule that hangs on it
    if bounded:
        return bounded
    layout = None
    if not isinstance(cfg.strategy, PSStrategy):
        layout, _ = Layout.resolve(cfg.strategy, cfg.hardware.world_size)
        if layout is not None and (bounded := limits.layout_problems(cfg, layout.pp)):
            return bounded
    ctx = Context(cfg, layout, launching)
    problems: list[Problem] = []
    for r in RULES:
        problems.extend(r(ctx))
    return problems


def resolve(cfg: RunConfig) -> RunConfig:
    """Fill derived values: the `auto` degree and train.accumulate_steps. cfg must be valid."""
    layout = None
    update: dict[str, Any] = {}
    if not isinstance(cfg.strategy, PSStrategy):
        layout, problems = Layout.resolve(cfg.strategy, cfg.hardware.world_size)
        assert layout is not None, problems
        update["strategy"] = cfg.strategy.model_copy(
            update={
                "dp_degree": layout.dp,
                "mp_degree": layout.mp,
                "pp_degree": layout.pp,
                "sharding_degree": layout.sharding,
            }
        )
    acc = num_microbatches(cfg, layout)
    update["train"] = cfg.train.model_copy(update={"accumulate_steps": acc})
    return cfg.model_copy(update=update)


def load_config(overrides: list[str], *, launching: bool = False) -> RunConfig:
    """Compose with Hydra and validate: every Hydra and validation problem in one ConfigError."""
    from fleetwise.config.compose import compose_partial

    data, hydra_problems = compose_partial(overrides)
    if not hydra_problems:
        return validate(data, launching=launching)
    if not data:
        raise ConfigError(hydra_problems)
    cfg, problems = parse(data)
    if cfg is not None:
        problems = check(cfg, launching=launching)
    raise ConfigError(hydra_problems + problems)


def validate(data: dict[str, Any], *, launching: bool = False) -> RunConfig:
    """Parse, check and resolve a composed config; raise ConfigError listing every problem."""
    cfg, problems = parse(data)
    if cfg is None:
        raise ConfigError(problems)
    problems = check(cfg, launching=launching)
    if problems:
        raise ConfigError(problems)
    return resolve(cfg)
