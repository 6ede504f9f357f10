"""When a plan does not fit: try the usual cures, alone and combined, and report what each would need.

The moves follow the memory-sources table of PaddlePaddle's 4D hybrid-parallel guide: shard more
state (a higher ZeRO stage, or the data-parallel ranks turned into a sharding group), recompute
activations, offload to the host, split the model further (mp inside a node, pp across nodes), and
smaller micro-batches (the global batch stays: more accumulation). Each candidate is a real config,
validated by the same rules as `fleetwise validate` and planned again; a move that saves less than
`MIN_SAVING` of the memory is not offered (e.g. recomputing activations when the peak is the
optimizer step), and a combination only when it fits where its parts do not, or saves clearly more.
Fitting remedies come first, the fastest planned step first: that is what "cheapest" means here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import (
    DEGREE_NAMES,
    CollectiveStrategy,
    DPStrategy,
    HybridStrategy,
    MPStrategy,
    PPStrategy,
    ShardingStrategy,
)
from fleetwise.config.validate import check, resolve
from fleetwise.families import family_of
from fleetwise.plan.planner import make_plan

GIB = 1024**3
MIN_SAVING = 0.05  # of the current total: a move that saves less barely helps and is not offered
MAX_PARTS = 3  # moves combined at most

# the smallest named strategy whose free degrees cover a layout (else hybrid)
PRESETS: tuple[type[CollectiveStrategy], ...] = (
    DPStrategy,
    ShardingStrategy,
    MPStrategy,
    PPStrategy,
    HybridStrategy,
)


@dataclass(frozen=True)
class Remedy:
    overrides: str  # add these to the command line (they override what is there)
    total_bytes: int
    fits: bool
    step_time_s: float = 0.0
    base_step_time_s: float = 0.0  # the plan being remedied

    def to_dict(self) -> dict[str, Any]:
        return {
            "overrides": self.overrides,
            "total_bytes": self.total_bytes,
            "fits": self.fits,
            "step_time_s": self.step_time_s,
        }

    def describe(self) -> str:
        text = f"{self.overrides} -> {self.total_bytes / GIB:.1f} GiB"
        if not self.fits:
            return text
        if self.base_step_time_s > 0 and self.step_time_s > 0:
            change = self.step_time_s / self.base_step_time_s - 1
            return f"{text} (fits; planned step {change:+.0%})"
        return f"{text} (fits)"


@dataclass(frozen=True)
class _Move:
    """One cure: strategy and train fields it sets (None: unset), as (name, value) pairs, and a
    change of degrees relative to the layout: "mp<dp" doubles mp and halves dp, "sharding<<dp"
    turns every data-parallel replica into a member of one sharding group."""

    strategy_items: tuple[tuple[str, Any], ...] = ()
    train_items: tuple[tuple[str, Any], ...] = ()
    degrees: str = ""

    @property
    def strategy(self) -> dict[str, Any]:
        return dict(self.strategy_items)

    @property
    def train(self) -> dict[str, Any]:
        return dict(self.train_items)

    @classmethod
    def of(cls, strategy: dict[str, Any], train: dict[str, Any] | None = None, degrees: str = "") -> _Move:
        return cls(tuple(strategy.items()), tuple((train or {}).items()), degrees)

    def keys(self) -> set[str]:
        grown = {f"grow.{self.degrees.split('<')[0]}"} if self.degrees else set()
        return {f"strategy.{k}" for k in self.strategy} | {f"train.{k}" for k in self.train} | grown


def _moves(cfg: RunConfig) -> list[_Move]:
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    lay = Layout.of(cfg)
    out: list[_Move] = []
    if lay.sharding > 1:
        for stage in range((s.sharding_stage or 0) + 1, 4):
            out.append(_Move.of({"sharding_stage": stage}))
    elif lay.dp > 1:
        for stage in (2, 3):
            out.append(_Move.of({"sharding_stage": stage}, degrees="sharding<<dp"))
    for mode in ("selective", "full"):
        if s.recompute != mode and not (s.recompute == "full" and mode == "selective"):
            out.append(_Move.of({"recompute": mode}))
    if lay.sharding > 1 and not s.offload and cfg.hardware.device_type == "cuda" and s.sharding_stage != 1:
        out.append(_Move.of({"offload": True}))
    for dim in ("mp", "pp"):
        if dim == "mp" and family_of(cfg.model).tensor_parallel is None:
            continue
        for donor in ("dp", "sharding"):
            if getattr(lay, donor) > 1:
                out.append(_Move.of({}, degrees=f"{dim}<{donor}"))
    mb = cfg.train.micro_batch_size // 2
    while mb >= 1:  # halvings, largest first (remedies() stops at the first that fits)
        out.append(_Move.of({}, {"micro_batch_size": mb}))
        mb //= 2
    return out


def _apply(cfg: RunConfig, moves: tuple[_Move, ...]) -> RunConfig | None:
    """cfg with the moves applied, degrees concrete, under the smallest strategy preset that allows
    them; None if the degrees do not divide."""
    lay = Layout.of(cfg)
    deg = {"dp": lay.dp, "mp": lay.mp, "pp": lay.pp, "sharding": lay.sharding}
    s_update: dict[str, Any] = {}
    t_update: dict[str, Any] = {"accumulate_steps": None}
    for m in sorted(moves, key=lambda m: m.degrees.count("<")):  # halvings before sharding<<dp
        s_update.update(m.strategy)
        t_update.update(m.train)
        if m.degrees == "sharding<<dp":
            deg["sharding"], deg["dp"] = deg["sharding"] * deg["dp"], 1
        elif m.degrees:
            dim, donor = m.degrees.split("<")
            if deg[donor] % 2:
                return None
            deg[dim], deg[donor] = deg[dim] * 2, deg[donor] // 2
    s_update.update({f"{k}_degree": v for k, v in deg.items()})
    if deg["sharding"] == 1:
        s_update["sharding_stage"] = None
    data = {**cfg.strategy.model_dump(), **s_update}
    above_one = {n for n in DEGREE_NAMES if data[n] > 1}
    current = type(cfg.strategy)
    preset = (
        current
        if above_one <= set(current.free_degrees)
        else next(p for p in PRESETS if above_one <= set(p.free_degrees))
    )
    data["name"] = preset.model_fields["name"].default
    return cfg.model_copy(
        update={
            "strategy": preset.model_validate(data),
            "train": cfg.train.model_copy(update=t_update),
        }
    )


def _text(cfg: RunConfig, candidate: RunConfig, moves: tuple[_Move, ...]) -> str:
    """Overrides that turn cfg's command line into the candidate: the keys that changed, every degree
    once a degree moves, and when the strategy preset changes, the preset too (a preset, or the
    recipe, brings degrees and keys of its own)."""
    old, new = cfg.strategy, candidate.strategy
    parts: list[str] = []
    keys: dict[str, Any] = {}
    renamed = new.name != old.name
    if renamed:
        parts.append(f"strategy={new.name}")
    if renamed or any(m.degrees for m in moves):
        keys.update({f"strategy.{n}": getattr(new, n) for n in DEGREE_NAMES})
    defaults = type(new)() if renamed else old
    for name, value in new.model_dump().items():
        if name not in ("name", *DEGREE_NAMES) and getattr(defaults, name) != value:
            keys[f"strategy.{name}"] = value
    for m in moves:
        keys.update({f"train.{k}": v for k, v in m.train.items()})
    for key, value in keys.items():
        if isinstance(value, bool):
            value = str(value).lower()
        parts.append(f"{key}={'null' if value is None else value}")
    return " ".join(parts)


def remedies(
    cfg: RunConfig, limit: int = 5, tolerate: frozenset[str] | set[str] = frozenset()
) -> list[Remedy]:
    """The cheapest ways to make `cfg` (resolved, valid) fit: moves alone and combined, each valid and
    planned; those that fit first (fastest planned step first), then those that save the most.
    `tolerate`: config paths of problems cfg already has (listed beside the memory problem), which
    do not disqualify a remedy."""
    if not isinstance(cfg.strategy, CollectiveStrategy):
        return []
    base = make_plan(cfg)
    total = base.memory_bytes["total"]
    # moves -> (total bytes, fits, step time, config), or None: invalid, or no gain over its parts
    planned: dict[tuple[_Move, ...], tuple[int, bool, float, RunConfig] | None] = {}

    def plan_of(moves: tuple[_Move, ...]):
        if moves not in planned:
            candidate = _apply(cfg, moves)
            if candidate is None or any(p.loc not in tolerate for p in check(candidate)):
                planned[moves] = None
            else:
                p = make_plan(resolve(candidate))
                planned[moves] = (p.memory_bytes["total"], p.fits, p.step_time_s, candidate)
        return planned[moves]

    useful = []
    smaller_batch_fits = False
    for move in _moves(cfg):
        if move.train and smaller_batch_fits:
            continue  # an even smaller micro-batch only costs time
        got = plan_of((move,))
        if got is not None and got[0] <= (1 - MIN_SAVING) * total:
            useful.append(move)
            smaller_batch_fits = smaller_batch_fits or bool(move.train and got[1])
    for size in range(2, MAX_PARTS + 1):
        if any(v is not None and v[1] for v in planned.values()) and size > 2:
            break  # something fits already: no need for three-move cures
        for combo in itertools.combinations(useful, size):
            keys = [m.keys() for m in combo]
            if any(a & b for a, b in itertools.combinations(keys, 2)):
                continue  # two moves of the same knob
            if any((v := planned.get(sub)) is not None and v[1] for sub in _subsets(combo)):
                continue  # a part already fits: combining adds cost, not a cure
            got = plan_of(combo)
            best_part = min(
                (v[0] for sub in _subsets(combo) if (v := planned.get(sub)) is not None), default=total
            )
            if got is not None and not got[1] and got[0] > best_part - MIN_SAVING * total:
                planned[combo] = None  # no clear gain over its parts
    found: dict[str, Remedy] = {}
    seen: set[str] = set()
    for moves, got in planned.items():
        if got is None or got[0] > (1 - MIN_SAVING) * total:
            continue
        memory, fits, step, candidate = got
        signature = f"{memory} {step:.6g}"  # e.g. ZeRO-3 under a pipeline is planned like ZeRO-2
        if signature in seen:
            continue
        seen.add(signature)
        text = _text(cfg, candidate, moves)
        found[text] = Remedy(text, memory, fits, step, base.step_time_s)
    ranked = sorted(
        found.values(),
        key=lambda r: (not r.fits, r.step_time_s if r.fits else r.total_bytes, r.overrides.count("=")),
    )
    return ranked[:limit]


def _subsets(combo: tuple[_Move, ...]) -> list[tuple[_Move, ...]]:
    return [sub for n in range(1, len(combo)) for sub in itertools.combinations(combo, n)]
