"""What a recipe sets, so that choosing another strategy on the command line gets that strategy's
own layout, and an error about a value the recipe set says so.

A recipe (`# @package _global_`) selects its strategy in its defaults list and sets that
strategy's degrees in its body (gpt3_175b: hybrid, mp 8 × pp 16). Hydra merges the body after
the group, so with `strategy=dp` on the command line the recipe's mp_degree=8 used to stay and
dp was refused for a value the user never set. The recipe's degrees belong to the recipe's
strategy: with another strategy, the `strategy` section is that group's own file plus the user's
`strategy.*` overrides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fleetwise.config.paths import config_dir, search_dirs
from fleetwise.config.problems import Problem

DEFAULT_RECIPE = "gpt/tiny"  # conf/config.yaml's defaults list


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _choice(overrides: list[str], group: str) -> str | None:
    found = [o.split("=", 1)[1] for o in overrides if "=" in o and _key(o) == group]
    return found[-1] if found else None


def _yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def recipe_file(name: str) -> Path | None:
    for base in search_dirs():
        path = base / "recipe" / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def recipe_of(overrides: list[str]) -> str:
    return _choice(overrides, "recipe") or DEFAULT_RECIPE


def _recipe(overrides: list[str]) -> dict[str, Any]:
    path = recipe_file(recipe_of(overrides))
    return _yaml(path) if path else {}


def recipe_strategy(recipe: dict[str, Any]) -> str | None:
    for item in recipe.get("defaults") or []:
        if isinstance(item, dict):
            for k, v in item.items():
                if str(k).replace("override", "").strip().lstrip("/") == "strategy":
                    return str(v)
    return None


def apply_strategy_choice(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`data` (a composed config) with the strategy section the user's `strategy=X` gives, when X
    is not the recipe's own strategy and the recipe set strategy keys."""
    chosen = _choice(overrides, "strategy")
    recipe = _recipe(overrides)
    if chosen is None or not isinstance(recipe.get("strategy"), dict) or recipe_strategy(recipe) == chosen:
        return data
    base = None
    for root in (config_dir(),):
        if (root / "strategy" / f"{chosen}.yaml").is_file():
            base = _yaml(root / "strategy" / f"{chosen}.yaml")
    if base is None or not isinstance(data.get("strategy"), dict):
        return data
    section = dict(base)
    for text in overrides:
        key = _key(text)
        if key.startswith("strategy.") and not text.startswith("~") and "=" in text:
            _set(section, key.split(".")[1:], _value(text))
    return {**data, "strategy": section}


def _value(text: str) -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    value = OverridesParser.create().parse_overrides([text])[0].value()
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value)
    return value


def _set(d: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        d = d.setdefault(part, {})
    d[path[-1]] = value


def recipe_values(overrides: list[str]) -> dict[str, Any]:
    """Dotted config paths the recipe sets and the user did not override (with their values)."""
    recipe = _recipe(overrides)
    chosen = _choice(overrides, "strategy")
    user = {_key(o) for o in overrides}
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = node

    for section, body in recipe.items():
        if section == "defaults" or (section == "strategy" and chosen and chosen != recipe_strategy(recipe)):
            continue
        walk(body, section)
    return {p: v for p, v in out.items() if p not in user and p.split(".")[0] not in user}


def mark_recipe_values(problems: list[Problem], overrides: list[str]) -> list[Problem]:
    """Problems about a value the recipe set say so (the user never typed it)."""
    values = recipe_values(overrides)
    if not values:
        return problems
    name = recipe_of(overrides)
    out = []
    for p in problems:
        hits = [
            path
            for path, value in values.items()
            if p.loc == path
            or f"{path}=" in p.msg
            or (not isinstance(value, (dict, list)) and f"{path.rsplit('.', 1)[-1]}({value})" in p.msg)
        ]
        if hits:
            shown = ", ".join(f"{h}={values[h]}" for h in hits[:4])
            p = Problem(
                p.loc,
                f"{p.msg} [set by recipe {name}: {shown}]",
                f"{p.hint}; or override {hits[0]} on the command line",
            )
        out.append(p)
    return out
