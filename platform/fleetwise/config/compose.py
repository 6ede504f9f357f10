"""Hydra composition: command-line overrides + conf/ + recipes/ -> a plain dict.

Hydra's own errors (unknown group option, a key that is not in the config, bad override syntax)
become `Problem`s like every validation error, so the user sees one format and exit code 2.
When composition fails, every override is tried on its own so that all bad ones are reported,
not only the first.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from typing import Any

from fleetwise.config.paths import config_dir, extra_config_dirs, group_options, user_config_dir
from fleetwise.config.problems import ConfigError, Problem, did_you_mean
from fleetwise.config.recipes import apply_strategy_choice

PRIMARY = "config"


def search_path_overrides(overrides: list[str]) -> list[str]:
    """Hydra override adding the `--config-dir` trees and the user config dir to the search path
    (those that exist, when the user did not set hydra.searchpath)."""
    dirs = [d for d in (*extra_config_dirs(), user_config_dir()) if d.is_dir()]
    if not dirs or any(o.lstrip("+").startswith("hydra.searchpath=") for o in overrides):
        return []
    return [f"hydra.searchpath=[{','.join(f'file://{d.resolve()}' for d in dirs)}]"]


def _is_group_override(text: str) -> bool:
    key = text.lstrip("+~").split("=", 1)[0]
    return "." not in key or "/" in key


# Within one _compose_partial, the compositions already made (a rejected override's diagnosis
# composes the base and the accepted overrides, which the final composition repeats): ~0.3 s each.
_COMPOSED: dict[tuple[tuple[str, ...], bool], Any] | None = None


def _compose(overrides: list[str], *, hydra_cfg: bool = False) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    key = (tuple(overrides), hydra_cfg)
    if _COMPOSED is not None and key in _COMPOSED:
        return copy.deepcopy(_COMPOSED[key])  # a copy: _to_dict deletes its hydra node
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3", job_name="fleetwise"):
        cfg = compose(PRIMARY, overrides=list(overrides) + search_path_overrides(overrides), return_hydra_config=hydra_cfg)
    if _COMPOSED is not None:
        _COMPOSED[key] = copy.deepcopy(cfg)
    return cfg


@contextlib.contextmanager
def _composing_memo() -> Iterator[None]:
    global _COMPOSED
    outer = _COMPOSED
    _COMPOSED = {} if outer is None else outer
    try:
        yield
    finally:
        _COMPOSED = outer


def _to_dict(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf, open_dict

    recipe = str(cfg.hydra.runtime.choices.get("recipe", ""))
    with open_dict(cfg):
        del cfg["hydra"]  # holds interpolations only a running Hydra app can resolve
    data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    assert isinstance(data, dict)
    data["recipe"] = recipe
    return data


def compose_config(overrides: list[str]) -> dict[str, Any]:
    """Compose the config for `overrides`; raise ConfigError listing every Hydra-level problem."""
    data, problems = compose_partial(overrides)
    if problems:
        raise ConfigError(problems)
    return data


# Hydra's own settings a user may override (documented in the README): where outputs go, and the
# launcher and sweeper plugins. Everything else under hydra.* is refused: `+hydra.callbacks.x._target_=...`
# would make `train` instantiate any importable callable. Other config trees come through
# `--config-dir` only: hydra.searchpath took any path (file:///etc was scanned for 9 s) and its
# pkg:// entries import a package.
HYDRA_OVERRIDES = (
    "hydra.run.dir",
    "hydra.sweep.dir",
    "hydra.sweep.subdir",
    "hydra.launcher.",
    "hydra/launcher",
    "hydra.sweeper.",
    "hydra/sweeper",
    "hydra.job.chdir",
)


def hydra_override_problems(overrides: list[str]) -> list[Problem]:
    out = []
    for text in overrides:
        key = text.lstrip("+~").split("=", 1)[0].split("@", 1)[0]
        if not (key == "hydra" or key.startswith(("hydra.", "hydra/"))):
            continue
        if any(key == a.rstrip(".") or (a.endswith(".") and key.startswith(a)) for a in HYDRA_OVERRIDES):
            continue
        if key == "hydra.searchpath":
            out.append(
                Problem(
                    key,
                    f"override {text!r} points Hydra at other config trees, which fleetwise takes only "
                    "through --config-dir (a searchpath may name any directory, and a pkg:// entry imports "
                    "a package)",
                    "give each tree of your own config groups as --config-dir DIR (repeat it for several), "
                    "e.g. fleetwise validate --config-dir my_conf recipe=mynet",
                )
            )
            continue
        out.append(
            Problem(
                key,
                f"override {text!r} changes Hydra's own configuration, which fleetwise does not allow "
                "(callbacks and other hydra.* targets would run arbitrary code at train time)",
                "allowed: hydra.run.dir, hydra.sweep.dir/subdir, hydra/launcher=… and hydra.launcher.*, "
                "hydra/sweeper and hydra.sweeper.*, hydra.job.chdir; other config trees: --config-dir DIR",
            )
        )
    return out


# One preflight composes the same overrides up to three times (with the launch rules, without them,
# and for the memory verdict as given), ~0.6 s of Hydra each: inside `composing_once` the first
# answer is reused (a copy each time: callers may change it).
_ONCE: dict[tuple[str, ...], tuple[dict[str, Any], list[Problem]]] | None = None


@contextlib.contextmanager
def composing_once() -> Iterator[None]:
    """Within: compose_partial of overrides already composed answers from memory."""
    global _ONCE
    outer = _ONCE
    if outer is None:
        _ONCE = {}
    try:
        yield
    finally:
        if outer is None:
            _ONCE = None


def compose_partial(overrides: list[str]) -> tuple[dict[str, Any], list[Problem]]:
    """Compose with every override Hydra accepts, and explain the ones it rejects.

    Returning the partial config lets validation report its own problems in the same run."""
    if _ONCE is None:
        return _compose_partial(overrides)
    key = tuple(overrides)
    if key not in _ONCE:
        _ONCE[key] = _compose_partial(overrides)
    data, problems = _ONCE[key]
    return copy.deepcopy(data), list(problems)


def _compose_partial(overrides: list[str]) -> tuple[dict[str, Any], list[Problem]]:
    with _composing_memo():
        return _compose_partial_memo(overrides)


def _compose_partial_memo(overrides: list[str]) -> tuple[dict[str, Any], list[Problem]]:
    refused = hydra_override_problems(overrides)
    if refused:
        kept = [o for o in overrides if not any(o.lstrip("+~").startswith(p.loc) for p in refused)]
        data, problems = compose_partial(kept)
        return data, refused + problems
    try:
        return apply_strategy_choice(_to_dict(_compose(list(overrides), hydra_cfg=True)), overrides), []
    except Exception as first:  # noqa: BLE001 - diagnosed below, then reported as problems
        problems, accepted = diagnose(list(overrides), first)
        try:
            return apply_strategy_choice(_to_dict(_compose(accepted, hydra_cfg=True)), accepted), problems
        except Exception:  # noqa: BLE001
            return {}, problems


def diagnose(overrides: list[str], first: BaseException) -> tuple[list[Problem], list[str]]:
    """Try overrides one at a time (group choices first) and explain each one Hydra rejects."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    accepted: list[str] = []
    problems: list[Problem] = []
    ordered = sorted(overrides, key=lambda o: not _is_group_override(o))
    for text in ordered:
        try:
            parser.parse_overrides([text])
        except Exception as exc:  # noqa: BLE001
            problems.append(
                Problem(
                    text.split("=", 1)[0] or text,
                    f"cannot parse override {text!r}: {_first_line(exc)}",
                    "write key=value (lists as key=[a,b], strings with spaces quoted); "
                    "see https://hydra.cc/docs/advanced/override_grammar/basic/",
                )
            )
            continue
        if len(overrides) == 1:  # alone, it is what failed: no second composition to find that out
            problems.append(_explain(text, first, accepted))
            continue
        try:
            _compose(accepted + [text], hydra_cfg=True)  # as the final composition will: memoized
            accepted.append(text)
        except Exception as exc:  # noqa: BLE001
            problems.append(_explain(text, exc, accepted))
    if not problems:  # the combination failed although each override alone was fine
        problems.append(Problem("<overrides>", _first_line(first), "check the overrides together"))
    return problems, accepted


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _explain(text: str, exc: BaseException, accepted: list[str]) -> Problem:
    from omegaconf import OmegaConf

    message = str(exc)
    key = text.lstrip("+~").split("=", 1)[0]
    value = text.split("=", 1)[1] if "=" in text else ""
    missing = re.search(r"Could not find '([^']+)'", message)
    if missing and _is_group_override(text):
        group = key.split("@")[0]
        options = group_options(group) if (config_dir() / group).is_dir() else []
        if not options:
            groups = sorted(p.name for p in config_dir().iterdir() if p.is_dir())
            return Problem(
                group,
                f"unknown config group '{group}'.{did_you_mean(group, groups)}",
                f"config groups are: {', '.join(groups)}",
            )
        return Problem(
            group,
            f"unknown option '{value}' for '{group}'.{did_you_mean(value, options)}",
            f"choose one of: {', '.join(options)}",
        )
    if "not in struct" in message or "Could not override" in message or "Could not delete" in message:
        parent, _, leaf = key.rpartition(".")
        try:
            base = _compose(accepted, hydra_cfg=True)
            node = OmegaConf.select(base, parent) if parent else base
            keys = node if node is not None and hasattr(node, "keys") else []
            known = sorted(str(k) for k in keys if parent or k != "hydra")
        except Exception:  # noqa: BLE001
            known = []
        if known:
            return Problem(
                key,
                f"unknown key '{leaf}' in '{parent or '<root>'}'.{did_you_mean(leaf, known)}",
                f"valid keys under {parent or 'the root'}: {', '.join(known)}",
            )
        return Problem(key, f"unknown config section '{parent}'", "check the spelling of the key")
    if "Multiple values for" in message:
        return Problem(key, f"'{key}' is given twice", "keep one override per key")
    return Problem(key or text, _first_line(exc), "check this override")
