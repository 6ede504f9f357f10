"""`strategy=auto`: search every legal collective layout with the planner and rank what fits.

A candidate is a real config (a `HybridStrategy` and a micro-batch size put into the user's
config), kept only when `config.validate.check` — the rules `validate` runs, through `Layout` —
finds nothing wrong with it; there is no second list of what is legal here. It is then planned by
`make_plan`, like any job.

Search space: the five degrees (mp up to `auto.max_mp`, by default one node; context parallelism
as below), the sharding stage, offload, sequence parallel, the pipeline schedule and virtual
stages, the micro-batch size (the global batch stays the recipe's) and recompute. Keys the user set on the command line
(`strategy.pp_degree=4`, `train.micro_batch_size=2`) stay fixed.

Speed (a 1,024-GPU search must answer in seconds): the model's units are built once
(chunks.units_of); each subtree of degrees × stage × offload is first planned at its least memory
(full recompute, micro-batch 1; 1F1B, else each other schedule) and dropped whole when even that
does not fit; inside it the micro-batch size grows only while memory still fits (memory grows with
it), a layout's pipeline ranks are worked out only until one is too big, and only fitting layouts
are timed. The degree tuples are independent: a large search runs them on forked workers.

Context parallelism (cp_degree with cp_method ring or ulysses) is searched for the families that have
it up to `auto.max_cp`; by default (null) up to one node (its ring or all-to-all runs every layer,
like mp's collectives) when seq_len >= CP_MIN_SEQ_LEN, and not below: there a sample's activations
are not what runs out of memory, the cp subtrees lengthen the search by 40-60% (llama/llama3_8b,
gpt/gpt3_175b), and the layouts of the recipes stay what they were. An explicit auto.max_cp searches
cp at any length (on llama/llama3_8b at 8k the planner then prefers cp 4 ulysses by 9%).
The rules decide what cp combines with (not ZeRO-1, …): a cp subtree they refuse at a key it holds
is skipped whole. cp with mp or pp runs (and matches one process), but the search tries it only
where the user fixes mp_degree or pp_degree: the planner's cp × mp numbers are checked against one
dry-run layout so far, and the search's picks (llama/llama3_8b_128k's) stay what they were.

Expert parallelism (ep_degree) is searched for a mixture of experts: every divisor of num_experts
that divides the tuple's data-parallel ranks (sharding × dp); the rules decide what it combines
with (DDP and ZeRO-2/3, with pp and mp but not cp, config/rules/moe.py), as for cp; a mixture of
experts under mp is searched without sequence parallelism (the rules refuse it). A dense model's
search, its output and overrides are what they were (ep 1 is not printed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fleetwise.config.problems import Problem
from fleetwise.config.rules.context_parallel import CP_FAMILIES
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import INTERLEAVED_SCHEDULES, HybridStrategy, Schedule
from fleetwise.config.validate import check, resolve
from fleetwise.families import family_of
from fleetwise.plan.memory.ranks import rank_memory, worst_of
from fleetwise.plan.planner import make_plan
from fleetwise.plan.records import Plan, step_parts

GIB = 1024**3
SCHEDULES: tuple[str, ...] = Schedule.__args__  # every schedule the config accepts
RECOMPUTE = ("none", "selective", "full")
# strategy keys the search sets; a user override of any of them fixes it
SEARCHED = (
    "dp_degree",
    "mp_degree",
    "pp_degree",
    "sharding_degree",
    "sharding_stage",
    "offload",
    "sequence_parallel",
    "schedule",
    "virtual_stages",
    "recompute",
    "cp_degree",
    "cp_method",
    "ep_degree",
)
# the sequence length from which strategy=auto searches context parallelism (module doc)
CP_MIN_SEQ_LEN = 32768
CP_METHODS = ("ulysses", "ring")


@dataclass
class Candidate:
    strategy: dict[str, Any]  # the searched strategy keys
    micro_batch_size: int
    plan: Plan
    why: str = ""

    @property
    def memory(self) -> int:
        return self.plan.memory_bytes["total"]

    def overrides(self) -> list[str]:
        """The overrides that reproduce this layout (with the user's other overrides)."""
        out = ["strategy=hybrid"]
        for key in SEARCHED:
            if key.startswith("cp_") and self.strategy.get("cp_degree", 1) == 1:
                continue  # the hybrid default: the overrides of layouts without cp stay as they were
            if key == "ep_degree" and self.strategy.get("ep_degree", 1) == 1:
                continue  # (likewise without experts split)
            value = self.strategy[key]
            text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            out.append(f"strategy.{key}={text}")
        out.append(f"train.micro_batch_size={self.micro_batch_size}")
        return out

    def layout_text(self) -> str:
        s = self.strategy
        parts = [
            f"dp{s['dp_degree']}",
            f"sh{s['sharding_degree']}",
            f"mp{s['mp_degree']}",
            f"pp{s['pp_degree']}",
        ]
        if s.get("cp_degree", 1) > 1:
            parts.append(f"cp{s['cp_degree']} {s['cp_method']}")
        if s.get("ep_degree", 1) > 1:
            parts.append(f"ep{s['ep_degree']}")
        if s["sharding_stage"]:
            parts.append(f"zero{s['sharding_stage']}" + ("+offload" if s["offload"] else ""))
        if s["sequence_parallel"]:
            parts.append("sp")
        if s["pp_degree"] > 1:
            parts.append(s["schedule"] + (f"×{s['virtual_stages']}" if s["virtual_stages"] > 1 else ""))
        parts.append(f"mb{self.micro_batch_size}")
        if s["recompute"] != "none":
            parts.append(f"rc={s['recompute']}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        return {
            "layout": self.layout_text(),
            "overrides": " ".join(self.overrides()),
            "memory_bytes": self.memory,
            "step_time_s": p.step_time_s,
            "mfu": p.mfu,
            "bubble_fraction": p.bubble_fraction,
            "why": self.why,
        }


@dataclass
class CpSummary:
    """One cp degree of a search: its fitting layouts, and its leanest layout when none fits."""

    cp: int
    fitting: int = 0
    best_step_s: float | None = None  # the fastest fitting one's step time
    least: Candidate | None = None  # the least memory seen, planned, when none fits

    def text(self, budget: int) -> str:
        from fleetwise.plan.render import gib

        if self.fitting:
            return f"cp {self.cp}: {self.fitting} fit, the fastest {self.best_step_s:.4g} s a step"
        if self.least is None:
            return f"cp {self.cp}: no legal layout"
        return (
            f"cp {self.cp}: none fits, the leanest needs {gib(self.least.memory)} > {gib(budget)} "
            f"({self.least.layout_text()}; {_largest_part(self.least)})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "fitting": self.fitting,
            "best_step_time_s": self.best_step_s,
            "least_memory_bytes": self.least.memory if self.least else None,
            "least_layout": self.least.layout_text() if self.least else None,
        }


def _largest_part(c: Candidate) -> str:
    """The largest part of a plan's worst-device memory, as the plan names it."""
    from fleetwise.plan.render import gib

    parts = {k: v for k, v in c.plan.memory_bytes.items() if k != "total" and isinstance(v, (int, float))}
    if not parts:
        return "memory"
    name = max(parts, key=lambda k: parts[k])
    return f"{name} {gib(parts[name])}"


@dataclass
class SearchResult:
    ranked: list[Candidate]  # fitting layouts, best first
    legal: int = 0  # layouts the rules accepted
    planned: int = 0  # layouts timed
    too_big: int = 0  # legal layouts (or whole subtrees) dropped for memory
    smallest: Candidate | None = None  # the least memory found when nothing fits
    # per cp degree searched (only when the search tried more than cp 1): how many layouts fit,
    # and for a degree where none does, its least memory (why shorter-context layouts are out)
    by_cp: dict[int, CpSummary] = field(default_factory=dict)
    budget_bytes: int = 0
    elapsed_s: float = 0.0
    fixed: dict[str, Any] = field(default_factory=dict)

    @property
    def winner(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


Degrees = tuple[int, int, int, int, int]  # (dp, sharding, mp, pp, cp)


def _degree_tuples(
    world: int, max_mp: int, fixed: dict[str, Any], cps: tuple[int, ...] = (1,)
) -> Iterator[Degrees]:
    """(dp, sharding, mp, pp, cp) with product = world, honouring fixed degrees, max_mp and the cp
    degrees searched (`cps`); the tuples without cp first, in the order they had before cp."""

    def allowed(name: str, value: int) -> bool:
        want = fixed.get(name)
        return want is None or want == "auto" or int(want) == value

    # cp × (mp or pp) only when asked for (the module's docstring)
    combine = any(fixed.get(k) not in (None, "auto") for k in ("mp_degree", "pp_degree"))
    for cp in cps:
        if world % cp:
            continue
        rest = world // cp
        for mp in _divisors(rest):
            if mp > max_mp or not allowed("mp_degree", mp):
                continue
            for pp in _divisors(rest // mp):
                if not allowed("pp_degree", pp) or (cp > 1 and (mp > 1 or pp > 1) and not combine):
                    continue
                for sh in _divisors(rest // (mp * pp)):
                    dp = rest // (mp * pp * sh)
                    if allowed("sharding_degree", sh) and allowed("dp_degree", dp):
                        yield dp, sh, mp, pp, cp


def ep_degrees(base: RunConfig, data: int, fixed: dict[str, Any]) -> tuple[int, ...]:
    """The ep degrees the search tries on `data` = sharding × dp ranks: the user's; else, for a
    mixture of experts, every divisor of num_experts that divides `data`; else 1."""
    if "ep_degree" in fixed:
        return (int(fixed["ep_degree"]),)
    moe = getattr(base.model, "moe", None)
    experts = moe.num_experts if moe is not None else 0
    return tuple(d for d in _divisors(experts) if data % d == 0) if experts else (1,)


def cp_degrees(base: RunConfig, max_cp: int | None, fixed: dict[str, Any]) -> tuple[int, ...]:
    """The cp degrees the search tries: the user's; else, for a family with context parallelism,
    every divisor of the world up to max_cp -- by default (null) one node's devices when seq_len >=
    CP_MIN_SEQ_LEN and none below. Which of them the rules accept with which other degrees is
    theirs to say."""
    if "cp_degree" in fixed:
        return (int(fixed["cp_degree"]),)
    hw, m = base.hardware, base.model
    if m.family not in CP_FAMILIES:
        return (1,)
    if max_cp is None:
        max_cp = hw.devices_per_node if getattr(m, "seq_len", 0) >= CP_MIN_SEQ_LEN else 1
    return tuple(d for d in _divisors(hw.world_size) if d <= max_cp)


# Pruning by where the rules locate a problem: a problem at a key that a subtree of the search
# holds fixed is not cured by the keys it varies below (the rules locate each problem at the key
# whose value is wrong; a pipeline split that fails at one virtual stage per rank fails at more).
# The candidates kept are still each checked whole; tests/unit/plan/test_auto_search.py holds the
# pruned search equal to a brute-force one.
SUBTREE_KEYS = frozenset(
    f"strategy.{k}"
    for k in (
        "dp_degree",
        "sharding_degree",
        "mp_degree",
        "pp_degree",
        "sharding_stage",
        "offload",
        "cp_degree",
        "cp_method",
        "ep_degree",
    )
)
# where the context-parallel rule locates what cp does not combine with or what the shapes refuse:
# keys no search varies (a cp subtree is sequence parallel off, every schedule and recompute alike)
CP_HELD_KEYS = SUBTREE_KEYS | {
    "model.seq_len",
    "model.dropout",
    "model.num_attention_heads",
    "model.num_kv_heads",
    "model.moe.num_experts",
    "train.compile",
    "data.source",
}
# where the expert-parallel rules locate what no searched key cures (config/rules/moe.py: fp16's
# loss scaling, compile, the experts' count)
EP_HELD_KEYS = SUBTREE_KEYS | {"train.precision", "train.compile", "model.moe.num_experts"}
PIPELINE_KEYS = frozenset({"strategy.schedule", "strategy.virtual_stages"})


def _held(problems: list[Problem], keys: frozenset[str]) -> bool:
    return any(p.loc in keys for p in problems)


def _choices(name: str, options: list[Any], fixed: dict[str, Any]) -> list[Any]:
    return [fixed[name]] if name in fixed else options


# The planner gives these schedules the same step time as their partner (same bubble, same chunk
# placement) and more memory (every micro-batch in flight): they never rank above it, so they are
# searched only when the user fixes them.
DOMINATED = {"GPipe": "1F1B", "looped_BFS": "interleaved_1F1B"}


def pipeline_options(cfg: RunConfig, pp: int, fixed: dict[str, Any]) -> list[tuple[str, int]]:
    """The (schedule, virtual stages) pairs the search tries at pipeline degree `pp` (the fixed
    ones where the user set them; no dominated schedule unless fixed)."""
    if pp == 1:
        return [(fixed.get("schedule", "1F1B"), fixed.get("virtual_stages", 1))]
    layers = getattr(cfg.model, "num_layers", pp)
    out = []
    schedules = (
        [s for s in SCHEDULES if s not in DOMINATED] if "schedule" not in fixed else [fixed["schedule"]]
    )
    for sched in schedules:
        if sched in INTERLEAVED_SCHEDULES:
            vs = (
                [v for v in range(2, layers // pp + 1) if (layers // pp) % v == 0] if layers >= 2 * pp else []
            )
        else:
            vs = [1]
        out += [(sched, v) for v in _choices("virtual_stages", vs, fixed)]
    return out


class _Progress:
    """A progress bar on stderr, shown only once a search has taken more than two seconds."""

    def __init__(self, total: int, show: bool):
        self.total, self.show, self.start, self.bar = total, show, time.perf_counter(), None

    def advance(self, done: int) -> None:
        if not self.show:
            return
        if self.bar is None and time.perf_counter() - self.start > 2.0:
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("searching layouts", total=self.total)
        if self.bar is not None:
            self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class _Subtrees:
    """The search's fixed inputs, and the search of one degree tuple (dp, sharding, mp, pp) with
    everything below it. Tuples are independent: `search` runs them in order, or on several
    processes at once, and merges what each found in tuple order (the same result either way)."""

    def __init__(self, base: RunConfig, fixed: dict[str, Any], objective: str, budget: int):
        self.base, self.fixed, self.objective, self.budget = base, fixed, objective, budget
        self.strategy_data = base.strategy.model_dump()
        # Recompute trades time for memory: none is fastest, full uses least. At one micro-batch
        # size only the first that fits is timed (for objective=memory: the leanest); the others of
        # the same layout are slower (or bigger) in every respect and never rank above it.
        self.order = list(RECOMPUTE) if objective == "time" else list(reversed(RECOMPUTE))

    def legal(self, strategy: dict[str, Any], mb: int) -> RunConfig | None:
        return self.checked(strategy, mb)[0]

    def checked(self, strategy: dict[str, Any], mb: int) -> tuple[RunConfig | None, list[Problem]]:
        base = self.base
        cand = base.model_copy(
            update={
                "strategy": HybridStrategy.model_construct(
                    **{**self.strategy_data, **strategy, "name": "hybrid"}
                ),
                "train": base.train.model_copy(update={"micro_batch_size": mb, "accumulate_steps": None}),
            }
        )
        problems = check(cand)
        return (None, problems) if problems else (resolve(cand), [])

    def run(self, degree_tuple: Degrees) -> _Found:
        out = _Found()
        dp, sh, mp, pp, cp = degree_tuple
        base, fixed = self.base, self.fixed
        gbs = base.train.global_batch_size
        ranks = dp * sh
        if gbs % ranks:
            return out
        mbs_all = _choices("micro_batch_size", _divisors(gbs // ranks), fixed)
        # under a pipeline FSDP keeps parameters gathered across micro-batches whatever the
        # stage, so the planner gives stage 3 the plan of stage 2: only the simpler is searched
        stages = ([1, 2, 3] if pp == 1 else [1, 2]) if sh > 1 else [None]
        # without cp the method is the config's (it does nothing); with cp both are tried
        methods = (
            _choices("cp_method", list(CP_METHODS), fixed) if cp > 1 else [self.strategy_data["cp_method"]]
        )
        eps = ep_degrees(base, dp * sh, fixed)
        for stage, offload, method, ep in self._subtrees(sh, stages, methods, eps):
            held = CP_HELD_KEYS if cp > 1 else EP_HELD_KEYS if ep > 1 else SUBTREE_KEYS
            degrees = {
                "dp_degree": dp,
                "sharding_degree": sh,
                "mp_degree": mp,
                "pp_degree": pp,
                "sharding_stage": stage,
                "offload": offload,
                "cp_degree": cp,
                "cp_method": method,
                "ep_degree": ep,
            }
            # the subtree at its least memory (full recompute, the smallest micro-batch,
            # sequence parallel; 1F1B, else each other schedule): if that does not fit,
            # nothing in it does
            lean = {
                **degrees,
                "sequence_parallel": fixed.get("sequence_parallel", mp > 1),
                "schedule": fixed.get("schedule", "1F1B"),
                "virtual_stages": fixed.get("virtual_stages", 1),
                "recompute": fixed.get("recompute", "full"),
            }
            if lean["schedule"] in INTERLEAVED_SCHEDULES and "virtual_stages" not in fixed:
                lean["schedule"] = "1F1B"
            cfg, problems = self.checked(lean, min(mbs_all))
            if _held(problems, held):
                continue  # no sequence parallel, schedule, recompute or micro-batch cures it
            if cfg is not None and not self._lean_fits(out, lean, cfg, min(mbs_all)):
                out.too_big += 1
                continue
            # sequence parallel: the planner gives it the same time (its all-gather and
            # reduce-scatter move what the all-reduce moved, Korthikanti et al. 2022) and
            # less memory; without it only when it is not legal (seq_len % mp)
            sps = [True, False] if mp > 1 else [False]
            for sp in _choices("sequence_parallel", sps, fixed):
                fitted = False
                for sched, v in pipeline_options(base, pp, fixed):
                    probe = {**lean, "sequence_parallel": sp, "schedule": sched, "virtual_stages": v}
                    if _held(self.checked(probe, min(mbs_all))[1], PIPELINE_KEYS):
                        continue  # e.g. ZBV with virtual_stages != 2, at every micro-batch size
                    modes = _choices("recompute", self.order, fixed)
                    for mb in mbs_all:  # ascending: memory only grows with it
                        modes = self._fastest_fitting(out, degrees, sp, sched, v, mb, modes)
                        if not modes:
                            break
                        fitted = True
                if fitted:
                    break
        return out

    def _subtrees(
        self, sh: int, stages: list[Any], methods: list[str], eps: tuple[int, ...]
    ) -> Iterator[tuple[Any, bool, str, int]]:
        """(sharding stage, offload, cp method, ep degree) of a degree tuple's subtrees, in search order."""
        for stage in _choices("sharding_stage", stages, self.fixed):
            offloads = (
                [False, True]
                if (sh > 1 and stage in (2, 3) and self.base.hardware.device_type == "cuda")
                else [False]
            )
            for offload in _choices("offload", offloads, self.fixed):
                for method in methods:
                    for ep in eps:
                        yield stage, offload, method, ep

    def _lean_fits(self, out: _Found, lean: dict[str, Any], cfg: RunConfig, mb: int) -> bool:
        """Whether the subtree's lean layout fits under 1F1B (`cfg`) or, failing that, under any
        other schedule: 1F1B is not always the leanest (zero bubble's weight steps can hold less
        than the loss's backward on a large vocabulary)."""
        mem = worst_of(rank_memory(cfg, out.stop_above(self.budget)))
        out.saw(mem, lean, mb)
        if mem <= self.budget:
            return True
        for sched, v in pipeline_options(self.base, lean["pp_degree"], self.fixed):
            if (sched, v) == (lean["schedule"], lean["virtual_stages"]):
                continue
            other = {**lean, "schedule": sched, "virtual_stages": v}
            cfg = self.legal(other, mb)
            if cfg is None:
                continue
            mem = worst_of(rank_memory(cfg, out.stop_above(self.budget)))
            out.saw(mem, other, mb)
            if mem <= self.budget:
                return True
        return False

    def _fastest_fitting(
        self, out: _Found, degrees: dict[str, Any], sp: bool, sched: str, v: int, mb: int, modes: list[str]
    ) -> list[str]:
        """Time the first recompute mode of `modes` that fits. Returns the modes still worth
        trying at a larger micro-batch (memory grows with it: a mode that did not fit here will
        not fit there); empty when none fits."""
        skipped: list[str] = []  # illegal here (not too big): tried again at the next size
        for i, recompute in enumerate(modes):
            strategy = {
                **degrees,
                "sequence_parallel": sp,
                "schedule": sched,
                "virtual_stages": v,
                "recompute": recompute,
            }
            cfg = self.legal(strategy, mb)
            if cfg is None:
                skipped.append(recompute)
                continue
            out.legal += 1
            memory = rank_memory(cfg, out.stop_above(self.budget))
            mem = worst_of(memory)
            out.saw(mem, strategy, mb)
            if mem > self.budget:
                out.too_big += 1
                if self.objective == "memory":
                    return []  # the modes after the leanest need more
                continue
            out.found.append(Candidate(dict(strategy), mb, make_plan(cfg, memory, per_stage=False)))
            return skipped + modes[i:]
        return []


@dataclass
class _Found:
    """What the search of one degree tuple found."""

    found: list[Candidate] = field(default_factory=list)
    legal: int = 0
    too_big: int = 0
    smallest: tuple[float, dict[str, Any], int] | None = None  # (memory, strategy, micro-batch size)

    def stop_above(self, budget: int) -> float:
        """Memory past which a layout's other ranks need not be worked out: it does not fit, and it
        cannot be the smallest seen (the one reported when nothing fits) either."""
        return math.inf if self.smallest is None else max(budget, self.smallest[0])

    def saw(self, mem: float, strategy: dict[str, Any], mb: int) -> None:
        if self.smallest is None or mem < self.smallest[0]:
            self.smallest = (mem, dict(strategy), mb)


# A search of more degree tuples than this runs them on several processes (fork: the workers
# inherit the model's units and the config; each returns its tuples' candidates)
PARALLEL_TUPLES = 16
_JOB: tuple[_Subtrees, list[Degrees]] | None = None  # what the forked workers run


def _run_tuple(i: int) -> _Found:
    assert _JOB is not None
    job, tuples = _JOB
    return job.run(tuples[i])


def search_workers() -> int:
    """Processes a large search runs on: this process's CPUs (at most 8); 1 where fork is not the
    way to start them (macOS, Windows: a spawned worker would import and rebuild everything)."""
    import multiprocessing
    import os
    import sys

    if sys.platform != "linux" or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return max(1, min(8, len(os.sched_getaffinity(0))))


def _each_tuple(job: _Subtrees, tuples: list[Degrees], workers: int, bar: _Progress) -> Iterator[_Found]:
    """`job.run` of every tuple, in tuple order."""
    global _JOB
    if workers <= 1 or len(tuples) < PARALLEL_TUPLES:
        for done, t in enumerate(tuples):
            bar.advance(done)
            yield job.run(t)
        return
    import multiprocessing

    _JOB = (job, tuples)
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            for done, part in enumerate(pool.imap(_run_tuple, range(len(tuples)))):
                bar.advance(done)
                yield part
    finally:
        _JOB = None


def search(
    base: RunConfig,
    fixed: dict[str, Any] | None = None,
    *,
    max_mp: int | None = None,
    max_cp: int | None = None,
    objective: str = "time",
    headroom: float = 0.10,
    progress: bool = False,
) -> SearchResult:
    """Every legal layout of `base`'s model, data, optimizer and hardware; those that fit in
    (1 - headroom) of the usable device memory, ranked by step time (objective=time) or memory.
    `fixed`: searched keys (SEARCHED, plus micro_batch_size) the user set. A large search runs on
    `search_workers()` processes; the result does not depend on how many."""
    fixed = dict(fixed or {})
    started = time.perf_counter()
    hw = base.hardware
    budget = int((hw.memory_per_device_bytes - hw.device_overhead_bytes) * (1 - headroom))
    max_mp = max_mp or hw.devices_per_node
    if family_of(base.model).tensor_parallel is None:
        max_mp = 1  # the family has no tensor-parallel plan
    result = SearchResult(ranked=[], budget_bytes=budget, fixed=fixed)
    job = _Subtrees(base, fixed, objective, budget)
    smallest: tuple[float, dict[str, Any], int] | None = None
    least_by_cp: dict[int, tuple[float, dict[str, Any], int]] = {}
    found: list[Candidate] = []
    tuples = list(_degree_tuples(hw.world_size, max_mp, fixed, cp_degrees(base, max_cp, fixed)))
    bar = _Progress(len(tuples), progress)
    try:
        for part in _each_tuple(job, tuples, search_workers(), bar):
            found += part.found
            result.legal += part.legal
            result.too_big += part.too_big
            if part.smallest is not None and (smallest is None or part.smallest[0] < smallest[0]):
                smallest = part.smallest
            if part.smallest is not None:  # exact: a tuple's first layout is worked out whole
                cp = part.smallest[1]["cp_degree"]
                if cp not in least_by_cp or part.smallest[0] < least_by_cp[cp][0]:
                    least_by_cp[cp] = part.smallest
    finally:
        bar.close()
    result.planned = len(found)

    def key(c: Candidate):
        # ties (layouts the model cannot tell apart) go to the simpler layout: fewer ranks in
        # model parallelism, no offload, no recompute
        simple = (
            c.strategy["pp_degree"] * c.strategy["mp_degree"] * c.strategy["cp_degree"],
            c.strategy["offload"],
            RECOMPUTE.index(c.strategy["recompute"]),
            c.strategy["virtual_stages"],
        )
        if objective == "memory":
            return (c.memory, c.plan.step_time_s, simple)
        # (to the nanosecond: equal times summed in another order differ in their last bits)
        return (round(c.plan.step_time_s, 9), c.memory, simple)

    found.sort(key=key)
    for c in found:
        c.why = explain(c, found[0], objective)
    result.ranked = found
    if smallest is not None and not found:
        mem, strategy, mb = smallest
        cfg = job.legal(strategy, mb)
        if cfg is not None:
            result.smallest = Candidate(dict(strategy), mb, make_plan(cfg))
    cps = sorted({t[4] for t in tuples})
    if len(cps) > 1:
        result.by_cp = _by_cp(job, cps, found, least_by_cp)
    result.elapsed_s = time.perf_counter() - started
    return result


def _by_cp(
    job: _Subtrees,
    cps: list[int],
    found: list[Candidate],
    least: dict[int, tuple[float, dict[str, Any], int]],
) -> dict[int, CpSummary]:
    out = {cp: CpSummary(cp) for cp in cps}
    for c in found:  # fastest first
        s = out[c.strategy["cp_degree"]]
        s.fitting += 1
        if s.best_step_s is None:
            s.best_step_s = c.plan.step_time_s
    for cp, s in out.items():
        if s.fitting == 0 and cp in least:
            _, strategy, mb = least[cp]
            cfg = job.legal(strategy, mb)
            if cfg is not None:
                s.least = Candidate(dict(strategy), mb, make_plan(cfg))
    return out


def explain(c: Candidate, best: Candidate, objective: str) -> str:
    """Why `c` wins, or what costs it the most against the winner."""
    if c is best:
        return "fastest that fits" if objective == "time" else "least memory"
    if objective == "memory":
        return f"+{(c.memory - best.memory) / GIB:.2f} GiB"
    # the additive parts of the step (compute split into GEMMs, host ops, …; dp/sharding comm as
    # exposed): their deltas add up to the step's, so the largest is what costs the most
    a, b = step_parts(c.plan.time_s), step_parts(best.plan.time_s)
    deltas = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a.keys() | b.keys()}
    worst = max(sorted(deltas), key=lambda k: deltas[k])
    slower = c.plan.step_time_s / best.plan.step_time_s - 1 if best.plan.step_time_s else 0.0
    if slower <= 1e-9:
        return f"ties #1 on time, {(c.memory - best.memory) / GIB:+.2f} GiB"
    return f"+{slower:.1%}: {PART_NAMES.get(worst, worst.replace('_', ' '))} {_sec(deltas[worst])}"


PART_NAMES = {  # step_parts' keys as the table says them
    "gemm": "GEMMs",
    "grad_accumulate": "grad accumulation",
    "comm_exposed_dp": "exposed dp comm",
    "comm_exposed_sharding": "exposed sharding comm",
}


def _sec(x: float) -> str:
    return f"{x * 1e3:+.1f} ms" if abs(x) < 1 else f"{x:+.2f} s"


def nothing_fits(result: SearchResult, headroom: float) -> Problem:
    """Exit-2 problem when no legal layout fits: the least memory found and what would make it fit."""
    from fleetwise.plan.render import gib

    if result.smallest is None:
        fixed = ", ".join(
            f"strategy.{k}={v}" if k != "micro_batch_size" else f"train.{k}={v}"
            for k, v in result.fixed.items()
        )
        return Problem(
            "strategy",
            "strategy=auto found no legal layout for this model and hardware"
            + (f" with {fixed} fixed" if fixed else ""),
            f"free the fixed keys ({fixed}), or change hardware.nodes / hardware.devices_per_node"
            if fixed
            else "change hardware.nodes / hardware.devices_per_node",
        )
    s = result.smallest
    ratio = s.memory / result.budget_bytes if result.budget_bytes else float("inf")
    fixed = f"; or free the fixed keys ({', '.join(sorted(result.fixed))})" if result.fixed else ""
    per_cp = "; ".join(  # context parallelism searched: what each degree needs at least
        f"cp {cp} needs {gib(c.least.memory)}" for cp, c in result.by_cp.items() if c.least is not None
    )
    return Problem(
        "hardware.memory_per_device_gib",
        f"no legal layout fits: the smallest needs {gib(s.memory)} per device ({s.layout_text()}) "
        f"but {gib(result.budget_bytes)} are allowed (usable device memory less auto.headroom={headroom:g})"
        + (f" ({per_cp})" if per_cp else ""),
        f"use about {ratio:.1f}× the devices (hardware.nodes), or devices with {gib(s.memory / (1 - headroom))} "
        f"usable memory, or a lower auto.headroom{fixed}",
    )
