"""The planner's one cache: what a layout search would otherwise rebuild for every candidate.

A search plans thousands of layouts of one model. Its units (pure arithmetic on the model config,
a third of a plan's time for a 96-layer GPT) are built once per model; units are frozen. Equal
units (a model's blocks, names aside) share a class key, so per-unit arithmetic is done once per
class. The chunk assignments made of those units are kept too (callers never mutate them), and so
is what is derived from one chunk list (the ranks' roles, a chunk's equal-unit groups, the
recompute counts), keyed by the list's identity.

Everything is in one `PlanCache` (`PLAN_CACHE`), which holds what it caches alive (so an identity
is never reused while its entry lives) and forgets it all with one `clear()`: when a new model
comes past `MAX_MODELS`, or by hand (a test, a long-lived process). Every entry is a pure
function of its key: clearing changes no plan, only how fast the next one is.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from fleetwise.plan.units import Unit

MAX_MODELS = 64  # models whose units are kept; one more clears everything
MAX_ENTRIES = 4096  # entries of one identity-keyed store; one more clears that store


@dataclass
class IdentityStore:
    """Values derived from an object, keyed by the object's identity (and an extra key). The object
    is kept beside its value, so its id cannot be taken by another object while the entry lives."""

    entries: dict[tuple[int, Hashable], tuple[object, Any]] = field(default_factory=dict)

    def get(self, obj: object, extra: Hashable = None) -> Any:
        held = self.entries.get((id(obj), extra))
        return held[1] if held is not None and held[0] is obj else None

    def put(self, obj: object, value: Any, extra: Hashable = None) -> Any:
        if len(self.entries) > MAX_ENTRIES:
            self.entries.clear()
        self.entries[(id(obj), extra)] = (obj, value)
        return value

    def clear(self) -> None:
        self.entries.clear()


@dataclass
class PlanCache:
    """The planner's cached arithmetic (see the module docstring); `clear()` forgets all of it."""

    # model config (its JSON) -> its units
    units: dict[str, list[Unit]] = field(default_factory=dict)
    # id(unit) -> the class of equal units it belongs to (for the cached units only)
    unit_class: dict[int, str] = field(default_factory=dict)
    # (id(units), chunks, explicit layer split) -> the units of each pipeline chunk
    chunks: dict[tuple, list[list[Unit]]] = field(default_factory=dict)
    # a chunk list (+ its ranks) -> every pipeline rank's role (chunks.rank_roles)
    roles: IdentityStore = field(default_factory=IdentityStore)
    # a chunk -> its units grouped by class (chunks.unit_groups)
    groups: IdentityStore = field(default_factory=IdentityStore)
    # a chunk list (+ whether the backward is split) -> recomputes per unit (chunks.block_recomputes)
    recomputes: IdentityStore = field(default_factory=IdentityStore)

    def class_of(self, unit: Unit) -> Hashable:
        """The class key of `unit`: equal units share one; a unit outside the cache is its own."""
        return self.unit_class.get(id(unit), id(unit))

    def clear(self) -> None:
        self.units.clear()
        self.unit_class.clear()
        self.chunks.clear()
        self.roles.clear()
        self.groups.clear()
        self.recomputes.clear()


PLAN_CACHE = PlanCache()
