"""Rules of the `model` section: each family checks its own shapes (`fleetwise.families`), and may
fill its raw section before it is parsed (`prefill`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fleetwise.config.problems import Problem
from fleetwise.config.rules.context import Context, rule
from fleetwise.families import FAMILIES, family_of


@rule
def model_shape(ctx: Context) -> Iterator[Problem]:
    yield from family_of(ctx.cfg.model).check(ctx.cfg.model)


def prefill(data: dict[str, Any]) -> tuple[dict[str, Any], list[Problem]]:
    """The model family's fill of the raw `model` section before it is parsed (Llama: the fields
    model.init_from's config.json sets), on a copy; with the problems it found (a value set
    explicitly that disagrees with the file, a missing or unsupported config.json)."""
    model = data.get("model")
    family = FAMILIES.get(model.get("family")) if isinstance(model, dict) else None
    if family is None or family.prefill is None:
        return data, []
    model = dict(model)
    problems = family.prefill(model)
    return {**data, "model": model}, problems
