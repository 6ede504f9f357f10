"""A config as the commands see it: composed and validated, its problems returned, not raised."""

from __future__ import annotations


def compose(*overrides: str):
    """Compose + validate; returns (RunConfig | None, problems)."""
    from fleetwise.config.problems import ConfigError
    from fleetwise.config.validate import load_config

    try:
        return load_config(list(overrides)), []
    except ConfigError as err:
        return None, err.problems
