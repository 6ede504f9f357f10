"""Shared pydantic base: every config section forbids unknown keys and is immutable."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. Unknown keys are errors (a typo must never be silently ignored)."""

    # allow_inf_nan=False: inf/nan in a rate, size or timeout only ever produced tracebacks or NaN
    # in the plan's JSON.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)
