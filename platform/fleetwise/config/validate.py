"""Validation: turn a composed config into a resolved `RunConfig`, or list every problem at once.

Two passes. First pydantic parses the raw dict (types, ranges, unknown keys; below). Then the rules
of config/rules/ check how sections fit together (degrees × world size, divisibility, batch
arithmetic, what a model family supports). Each rule yields `Problem`s naming the config path, the
values and a fix; all of them run, so a user sees every mistake in one go. Finally `resolve` fills
the derived values (an `auto` degree, `train.accumulate_steps`) so workers see concrete numbers.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ValidationError

from fleetwise.config.layout import Layout
from fleetwise.config.problems import ConfigError, Problem, did_you_mean
from fleetwise.config.rules import RULES
from fleetwise.config.rules.context import Context, num_microbatches
from fleetwise.config.rules.launch import elastic_candidate, elastic_problems
from fleetwise.config.rules.model import prefill
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import DEGREE_NAMES, PSStrategy

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
                    (f"remove it; valid keys here: {', '.join(known)}" if known else "remove it")
                    + " (`+key=value` adds keys only under tracking.tags)",
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
            msgs = "; or ".join(dict.fromkeys(e["msg"].removeprefix("Value error, ") for e in errs))
            problems.append(Problem(path, f"invalid value {value!r}: {msgs}", _type_hint(path, errs)))
    return problems


def _type_hint(path: str, errs: list[dict[str, Any]]) -> str:
    if path.startswith("strategy.") and path.endswith("_degree"):
        return f"set {path} to a positive integer, 'auto' or 'max'"
    for e in errs:
        if e["type"] == "value_error":  # our validators say what to do in their message
            return f"set {path} as the message says"
        if e["type"] == "literal_error":
            return f"set {path} to one of {e['ctx']['expected']}"
        if e["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            return f"set {path} within the allowed range ({e['msg'].lower()})"
    return f"set {path} to a valid {errs[0]['type'].split('_')[0]} value"


def _section_of(cls: type[BaseModel], node: Any, key: str) -> type[BaseModel] | None:
    """The model class of `cls.key` for the data `node[key]`: a discriminated union's member by
    its tag (strategy.name, model.family)."""
    field = cls.model_fields.get(key)
    if field is None:
        return None
    members = [a for a in _flatten_union(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    child = node.get(key) if isinstance(node, dict) else None
    for member in members:
        tags = {f: get_args(m.annotation) for f, m in member.model_fields.items() if get_origin(m.annotation) is Literal}
        if len(members) == 1 or any(isinstance(child, dict) and child.get(f) in v for f, v in tags.items()):
            return member
    return None


def _number_only(annotation: Any) -> bool:
    """A field that takes numbers (int, float, optional or listed) but no yes/no value."""
    leaves = set(_flatten_union(annotation))
    return bool(leaves & {int, float}) and not leaves & {bool, Any}


def _yes_no_for_numbers(data: dict[str, Any]) -> list[Problem]:
    """true/false where a number is expected. pydantic's lax mode reads true as 1 (train.steps=true
    ran one step, hardware.nodes=true planned one node), so these are refused before it runs."""
    problems: list[Problem] = []

    def walk(cls: type[BaseModel], node: dict[str, Any], path: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                sub = _section_of(cls, node, key)
                if sub is not None:
                    walk(sub, value, f"{path}{key}.")
            elif (
                isinstance(value, bool)
                and key in cls.model_fields
                and _number_only(cls.model_fields[key].annotation)
            ):
                problems.append(
                    Problem(
                        f"{path}{key}",
                        f"invalid value {value!r}: a yes/no value where a number is expected",
                        f"set {path}{key} to a number",
                    )
                )

    walk(RunConfig, data, "")
    return problems


def parse(data: dict[str, Any]) -> tuple[RunConfig | None, list[Problem]]:
    """The RunConfig of a composed config (None when pydantic refuses it), and the problems found
    so far (a RunConfig may come with the prefill's problems: the rules still run on it)."""
    data, filled = prefill(data)  # the family's fill of the raw model section (Llama: model.init_from)
    yes_no = _yes_no_for_numbers(data)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        flagged = {p.loc for p in yes_no}
        return None, filled + yes_no + [p for p in _pydantic_problems(err, data) if p.loc not in flagged]
    return (None, filled + yes_no) if yes_no else (cfg, filled)


# ---------------------------------------------------------------------------------------------
# Entry points


def _divisors_down(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def fill_max(cfg: RunConfig) -> RunConfig:
    """Replace each `max` degree (mp first, then pp) by the largest divisor of what the numbered
    degrees leave of the world size that adds no problem to the config: the rules decide (heads
    that an mp degree must divide, layers a pipeline needs, micro-batches per stage...), never a
    second copy of them. A family without tensor parallelism or pipelining gets 1."""
    s = cfg.strategy
    if isinstance(s, PSStrategy) or "max" not in (s.degree(n) for n in DEGREE_NAMES):
        return cfg
    names = [n for n in ("mp_degree", "pp_degree", "sharding_degree", "dp_degree") if s.degree(n) == "max"]

    def with_degrees(**degrees: Any) -> RunConfig:
        return cfg.model_copy(update={"strategy": cfg.strategy.model_copy(update=degrees)})

    chosen = {n: 1 for n in names}
    for name in names:
        fixed = math.prod(int(v) for n in DEGREE_NAMES if isinstance(v := s.degree(n), int)) * s.cp_degree
        left = cfg.hardware.world_size // fixed // math.prod(v for n, v in chosen.items() if n != name)
        baseline = {p.loc for p in check(with_degrees(**{**chosen, name: 1}))}
        for d in _divisors_down(max(1, left)):
            if d == 1 or {p.loc for p in check(with_degrees(**{**chosen, name: d}))} <= baseline:
                chosen[name] = d
                break
    return with_degrees(**chosen)


def check(cfg: RunConfig, *, launching: bool = False, dryrun: bool = False) -> list[Problem]:
    """Every problem of a parsed config: bounds first, then every rule (rules/). `launching`: the
    rules about starting processes too (`train`); `dryrun`: the dry run's instead of the launch
    section's (`fleetwise dryrun`)."""
    from fleetwise.config.rules import limits

    cfg = fill_max(cfg)
    bounded = limits.problems(cfg)  # first: an absurd value must not reach a rule that hangs on it
    if bounded:
        return bounded
    layout = None
    if not isinstance(cfg.strategy, PSStrategy):
        layout, _ = Layout.resolve(cfg.strategy, cfg.hardware.world_size)
        if layout is not None and (bounded := limits.layout_problems(cfg, layout.pp)):
            return bounded
    ctx = Context(cfg, layout, check=check, launching=launching, dryrun=dryrun)
    problems: list[Problem] = []
    for r in RULES:
        problems.extend(r(ctx))
    return problems


def resolve(cfg: RunConfig) -> RunConfig:
    """Fill derived values: `max` and `auto` degrees and train.accumulate_steps. cfg must be valid."""
    cfg = fill_max(cfg)
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


def load_config(overrides: list[str], *, launching: bool = False, dryrun: bool = False) -> RunConfig:
    """Compose with Hydra and validate: every Hydra and validation problem in one ConfigError."""
    from fleetwise.config.compose import compose_partial

    data, hydra_problems = compose_partial(overrides)
    if not hydra_problems:
        return validate(data, launching=launching, dryrun=dryrun)
    if not data:
        raise ConfigError(hydra_problems)
    cfg, problems = parse(data)
    if cfg is not None:
        problems = problems + check(cfg, launching=launching, dryrun=dryrun)
    raise ConfigError(hydra_problems + problems)


def validate(data: dict[str, Any], *, launching: bool = False, dryrun: bool = False) -> RunConfig:
    """Parse, check and resolve a composed config; raise ConfigError listing every problem."""
    cfg, problems = parse(data)
    if cfg is None:
        raise ConfigError(problems)
    problems = problems + check(cfg, launching=launching, dryrun=dryrun)
    if problems:
        raise ConfigError(problems)
    return resolve(cfg)


def elastic_config(cfg: RunConfig, world_size: int) -> RunConfig:
    """The config for an elastic job that started with `world_size` ranks (rules/launch.py
    `elastic_candidate`), validated as a whole for the new size and resolved."""
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
    candidate = elastic_candidate(cfg, world_size // per_node)
    problems = elastic_problems(check(candidate))
    if problems:
        raise ConfigError(problems)
    return resolve(candidate)
