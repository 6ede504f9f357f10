"""`strategy=auto` on the command line: compose the user's config as a hybrid job, search every
legal layout (plan/search.py) and hand the winner on as the overrides that reproduce it, so that
`validate`, `plan`, `train` and `dryrun` then treat it like any typed-in layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetwise.config.problems import Problem
from fleetwise.config.run import RunConfig
from fleetwise.plan.search import SEARCHED, Candidate, SearchResult, nothing_fits, search

AUTO = "strategy=auto"
FIXABLE = {f"strategy.{k}" for k in SEARCHED} | {"train.micro_batch_size"}


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0].strip()


def requested(overrides: list[str]) -> bool:
    return any(o.replace(" ", "") == AUTO for o in overrides)


@dataclass
class AutoOutcome:
    """The search and the overrides it hands on (the user's, with the winner's layout)."""

    result: SearchResult | None = None
    base: RunConfig | None = None
    layout_overrides: list[str] = field(default_factory=list)  # the winner: strategy=hybrid …
    command: list[str] = field(default_factory=list)  # the user's other overrides + the winner's
    problems: list[Problem] = field(default_factory=list)

    @property
    def override_text(self) -> str:
        return " ".join(self.layout_overrides)

    def to_dict(self, top_k: int | None = None) -> dict[str, Any]:
        r = self.result
        k = top_k or (self.base.auto.top_k if self.base else 10)
        return {
            "override": self.override_text,
            "command": " ".join(self.command),
            "fixed": {key: v for key, v in (r.fixed if r else {}).items()},
            "objective": self.base.auto.objective if self.base else "time",
            "headroom": self.base.auto.headroom if self.base else None,
            "budget_bytes": r.budget_bytes if r else None,
            "legal": r.legal if r else 0,
            "planned": r.planned if r else 0,
            "fitting": len(r.ranked) if r else 0,
            "search_s": r.elapsed_s if r else 0.0,
            "candidates": [c.to_dict() for c in (r.ranked[:k] if r else [])],
            "by_cp": {str(cp): s.to_dict() for cp, s in r.by_cp.items()} if r else {},
        }


def resolve_auto(overrides: list[str], *, progress: bool = True) -> AutoOutcome:
    """Search the layouts of the config `overrides` describe (one of them `strategy=auto`)."""
    from fleetwise.config.compose import compose_partial
    from fleetwise.config.validate import parse

    others = [o for o in overrides if o.replace(" ", "") != AUTO]
    data, problems = compose_partial(["strategy=hybrid", *others])
    base, parse_problems = parse(data) if data else (None, [])
    problems = problems + parse_problems
    if problems or base is None:
        return AutoOutcome(problems=problems)
    s = base.strategy
    fixed: dict[str, Any] = {}
    for o in others:
        key = _key(o)
        if key in FIXABLE:
            section, name = key.split(".")
            fixed[name] = getattr(base.train if section == "train" else s, name)
    if fixed.get("sharding_stage", 0) is None and "sharding_degree" not in fixed:
        fixed.pop("sharding_stage")  # `sharding_stage=null` as typed for the hybrid preset: let it follow
    a = base.auto
    result = search(
        base,
        fixed,
        max_mp=a.max_mp,
        max_cp=a.max_cp,
        objective=a.objective,
        headroom=a.headroom,
        progress=progress,
    )
    out = AutoOutcome(result=result, base=base)
    if result.winner is None:
        out.problems = [nothing_fits(result, a.headroom)]
        return out
    out.layout_overrides = result.winner.overrides()
    # the winner's keys replace the user's (fixed ones have the same values)
    replaced = FIXABLE | {"strategy"}
    out.command = [o for o in others if _key(o) not in replaced] + out.layout_overrides
    return out


def table_rows(outcome: AutoOutcome) -> list[Candidate]:
    r = outcome.result
    k = outcome.base.auto.top_k if outcome.base else 10
    return r.ranked[:k] if r else []
