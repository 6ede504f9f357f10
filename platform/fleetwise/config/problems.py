"""A config problem: where it is, what is wrong (with the values), and how to fix it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Problem:
    loc: str
    msg: str
    hint: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


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
