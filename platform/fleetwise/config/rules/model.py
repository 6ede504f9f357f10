"""Rules of the `model` section: each family checks its own shapes (`fleetwise.families`)."""

from __future__ import annotations

from collections.abc import Iterator

from fleetwise.config.problems import Problem
from fleetwise.config.rules.context import Context, rule
from fleetwise.families import family_of


@rule
def model_shape(ctx: Context) -> Iterator[Problem]:
    yield from family_of(ctx.cfg.model).check(ctx.cfg.model)
