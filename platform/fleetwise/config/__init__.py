"""Config: pydantic schemas, Hydra composition and validation. Never imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetwise.config.problems import ConfigError, Problem
    from fleetwise.config.run import RunConfig

__all__ = ["ConfigError", "Problem", "RunConfig"]


def __getattr__(name: str):
    # Lazy (PEP 562): the model families import `config.base` and `config.problems` while the
    # `model` schema imports the families, so importing this package must not pull in `run`.
    if name in ("ConfigError", "Problem"):
        from fleetwise.config import problems

        return getattr(problems, name)
    if name == "RunConfig":
        from fleetwise.config.run import RunConfig

        return RunConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
