"""The repository the tests run in: its root, and its scripts/ loaded as modules."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def netns_module() -> ModuleType:
    """scripts/netns_hosts.py (network namespaces as hosts), which is no package module."""
    spec = importlib.util.spec_from_file_location("netns_hosts", REPO / "scripts" / "netns_hosts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
