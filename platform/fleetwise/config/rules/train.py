"""Rules of the `train`, `hardware`, `data` and `optim` sections: the batch triad, precision,
backend, data source and the LR schedule."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from fleetwise.config.problems import Problem
from fleetwise.config.rules.context import Context, data_parallel_ranks, rule
from fleetwise.config.strategy import PSStrategy
from fleetwise.families import FAMILIES, family_of


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
def compile_supported(ctx: Context) -> Iterator[Problem]:
    if ctx.cfg.train.compile and isinstance(ctx.cfg.strategy, PSStrategy):
        yield Problem(
            "train.compile",
            "train.compile=true compiles the blocks of a collective strategy's model; strategy=ps runs its "
            "trainers eagerly (the dense part is small; the embeddings live on the servers)",
            "set train.compile=false with strategy=ps, or use a collective strategy (dp, sharding, …)",
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
    wants = tuple(name for name, f in FAMILIES.items() if d.source in f.data_sources)
    if d.source not in family_of(m).data_sources:
        yield Problem(
            "data.source",
            f"data.source={d.source} feeds {'/'.join(wants)} models, not {m.family}",
            "use data.source=synthetic or a reader for this model family",
        )
        return
    if d.source == "bundled":
        yield from _bundled_fits(m)
        return
    if d.source == "custom":  # your own Dataset: checked with the model (families/custom/derive.py)
        return
    if d.source == "jsonl":
        yield from _jsonl_pipeline(ctx)
    if not d.path:
        yield Problem("data.path", f"data.source={d.source} needs a path", "set data.path=/path/to/data")
        return
    from fleetwise.config.rules.datafiles import check_data_file  # local: only file-backed configs pay for it

    yield from check_data_file(d.source, Path(d.path), m, d)


@rule
def optimizer_schedule(ctx: Context) -> Iterator[Problem]:
    o = ctx.cfg.optim
    # warmup_steps > train.steps is allowed (a 4-step smoke test of a real recipe): the warm-up is
    # cut short, and the plan says so (plan/planner.py notes)
    b1, b2 = o.betas
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        yield Problem(
            "optim.betas", f"betas={list(o.betas)} must lie in [0, 1)", "e.g. optim.betas=[0.9,0.95]"
        )


def _jsonl_pipeline(ctx: Context) -> Iterator[Problem]:
    """Packed documents carry their positions beside the tokens into every block; a pipeline
    schedule passes the hidden states alone between stages."""
    pp = ctx.layout.pp if ctx.layout else ctx.cfg.strategy.pp_degree if ctx.collective else 1
    if isinstance(pp, int) and pp > 1:
        yield Problem(
            "strategy.pp_degree",
            f"data=jsonl packs documents with per-document positions and attention masks, which do not "
            f"pass between pipeline stages; pp_degree={pp}",
            "set strategy.pp_degree=1 and shard instead (strategy=sharding, strategy.mp_degree for tensor "
            "parallelism), or train on data=token_file",
        )


def _bundled_fits(m) -> Iterator[Problem]:
    """The bundled sets' shapes: byte tokens need 256 ids, the digits 10 classes."""
    vocab = getattr(m, "vocab_size", None)
    if vocab is not None and vocab < 256:
        yield Problem(
            "model.vocab_size",
            f"data.source=bundled is byte-level text (ids 0-255) but vocab_size={vocab}",
            "set model.vocab_size=256 or more",
        )
    classes = getattr(m, "num_classes", None)
    if classes is not None and classes < 10:
        yield Problem(
            "model.num_classes",
            f"data.source=bundled is the 10 handwritten digits but num_classes={classes}",
            "set model.num_classes=10",
        )
