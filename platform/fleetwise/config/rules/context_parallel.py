"""Rules of context parallelism (`strategy.cp_degree`, `strategy.cp_method`; runtime/context_parallel.py):
the shapes it needs, the families that have it, and what this stage of it does not combine with --
each refused with the reason and what to do instead, never run differently from what was asked.

Shapes: the sequence is cut into 2·cp chunks (head-tail load balance), so seq_len divides by 2·cp;
with sequence parallelism the mp ranks cut a cp rank's two chunks (laid end to end) into mp equal
pieces between the blocks, and each chunk is asked to split evenly too (the issue's rule: every
piece within one chunk), so seq_len divides by 2·cp·mp. Ulysses hands each cp rank
1/cp of the heads an mp rank holds (tensor parallelism splits them first), so the query heads and
Llama's kv heads divide by cp·mp.
Packed documents (data=jsonl) run with either method: attention masks by document across the chunks
(runtime/context_parallel.py). Not yet combined: ZeRO-1 (its gradient reduction spans sharding and dp,
not cp), torch.compile (the blockwise attention's loop and collectives are not traced), attention
dropout and mixtures of experts.
"""

from __future__ import annotations

from collections.abc import Iterator

from fleetwise.config.problems import Problem
from fleetwise.config.rules.context import Context, rule

CP_FAMILIES = ("gpt", "llama")  # the causal decoders, whose attention and positions take a SeqShard


@rule
def context_parallel(ctx: Context) -> Iterator[Problem]:
    s = ctx.collective
    if s is None or s.cp_degree == 1:
        return
    cp = s.cp_degree
    here = f"cp_degree={cp}"
    if s.name != "hybrid":
        yield Problem(
            "strategy.cp_degree",
            f"strategy '{s.name}' keeps cp_degree at 1; got {cp}",
            f"use strategy=hybrid strategy.cp_degree={cp} (with the other degrees you need), or set "
            "strategy.cp_degree=1",
        )
    mp = ctx.layout.mp if ctx.layout else s.mp_degree
    yield from _model(ctx, cp, s.cp_method, mp if isinstance(mp, int) else 1, s.sequence_parallel)
    yield from _combinations(ctx, here)


def _model(ctx: Context, cp: int, method: str, mp: int, sequence_parallel: bool) -> Iterator[Problem]:
    m = ctx.cfg.model
    if m.family not in CP_FAMILIES:
        yield Problem(
            "strategy.cp_degree",
            f"model family '{m.family}' has no context parallelism (cp_degree={cp}): fleetwise splits the "
            f"sequences of causal decoders only ({', '.join(CP_FAMILIES)})",
            "set strategy.cp_degree=1, and split the job with dp_degree or sharding_degree",
        )
        return
    sp = mp if sequence_parallel else 1  # sequence parallelism splits each cp rank's chunks over mp
    unit = 2 * cp * sp
    if m.seq_len % unit:
        fits = [c for c in range(cp, 0, -1) if m.seq_len % (2 * c * sp) == 0][:1]
        split = f" × mp_degree {mp} (sequence parallel)" if sp > 1 else ""
        yield Problem(
            "model.seq_len",
            f"seq_len={m.seq_len} does not divide into 2 × cp_degree{split} = {unit} equal pieces (each cp "
            "rank holds a head and a tail chunk of every sequence"
            + (", each split again over the mp ranks)" if sp > 1 else ")"),
            f"set model.seq_len to a multiple of {unit} (e.g. {m.seq_len - m.seq_len % unit or unit})"
            + (f", or strategy.cp_degree={fits[0]}" if fits and fits[0] > 1 else ""),
        )
    if getattr(m, "dropout", 0.0):
        yield Problem(
            "model.dropout",
            f"dropout={m.dropout} with cp_degree={cp}: the blockwise attention of context parallelism has no "
            "attention dropout",
            "set model.dropout=0, or strategy.cp_degree=1",
        )
    if method != "ulysses":
        return
    heads = {"model.num_attention_heads": m.num_attention_heads}
    if getattr(m, "num_kv_heads", None) is not None:
        heads["model.num_kv_heads"] = m.num_kv_heads
    by = f"cp_degree={cp} × mp_degree={mp} = {cp * mp}" if mp > 1 else f"cp_degree={cp}"
    for path, n in heads.items():
        if n % (cp * mp):
            yield Problem(
                path,
                f"{path.split('.')[-1]}={n} does not divide by {by}: cp_method=ulysses gives each cp "
                "rank a whole share of the heads"
                + (" an mp rank holds (tensor parallelism splits them first)" if mp > 1 else ""),
                "use strategy.cp_method=ring (any head count), or a cp_degree"
                + (" × mp_degree" if mp > 1 else "")
                + f" dividing {n}",
            )


def _combinations(ctx: Context, here: str) -> Iterator[Problem]:
    s, cfg = ctx.collective, ctx.cfg
    assert s is not None
    if s.sharding_stage == 1:
        yield Problem(
            "strategy.sharding_stage",
            f"sharding_stage=1 (ZeRO-1) with {here}: its gradient reduction spans sharding and dp ranks, "
            "not cp ranks",
            "use strategy.sharding_stage=2 or 3 (FSDP shards over sharding × cp), or strategy.cp_degree=1",
        )
    if cfg.train.compile:
        yield Problem(
            "train.compile",
            f"train.compile=true with {here}: the blockwise attention (a loop over chunks with collectives) "
            "is not traced into a block's graph",
            "set train.compile=false",
        )
    moe = getattr(cfg.model, "moe", None)
    if moe is not None and moe.num_experts:
        yield Problem(
            "model.moe.num_experts",
            f"num_experts={moe.num_experts} with {here}: mixtures of experts are not combined with "
            "context parallelism yet",
            "set strategy.cp_degree=1, or model.moe.num_experts=0",
        )
