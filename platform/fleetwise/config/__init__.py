"""Config: pydantic schemas, Hydra composition and validation. Never imports torch."""

from fleetwise.config.problems import ConfigError, Problem
from fleetwise.config.run import RunConfig

__all__ = ["ConfigError", "Problem", "RunConfig"]
