"""A config problem: where it is, what is wrong (with the values), and how to fix it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Problem:
    loc: str
    msg: str
    hint: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def beyond_limit(path: str, value: float, limit: float) -> Problem:
    """A size beyond what the planner represents (the bounds of config/rules/limits.py and the
    families' own)."""
    return Problem(
        path,
        f"{path}={value:,} is beyond what fleetwise plans (at most {limit:,})",
        f"set {path} to at most {limit:,}",
    )


def over_limits(section: object, limits: dict[str, float]) -> Iterator[Problem]:
    """`beyond_limit` for each config path of `limits` (path -> largest value) whose field, read
    from `section` by the path's last name, is set and above it."""
    for path, limit in limits.items():
        value = getattr(section, path.rsplit(".", 1)[1])
        if value is not None and value > limit:
            yield beyond_limit(path, value, limit)


class ConfigError(Exception):
    """Raised with every problem of a config at once; the CLI prints them and exits 2."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        super().__init__("; ".join(f"{p.loc}: {p.msg}" for p in self.problems))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean x?' when a choice is close to word, else ''."""
    close = difflib.get_close_matches(word, list(choices), n=2, cutoff=0.6)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"
