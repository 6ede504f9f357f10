"""Hydra composition: command-line overrides + conf/ + recipes/ -> a plain dict.

Hydra's own errors (unknown group option, a key that is not in the config, bad override syntax)
become `Problem`s like every validation error, so the user sees one format and exit code 2.
When composition fails, every override is tried on its own so that all bad ones are reported,
not only the first.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from collections.abc import Iterator
from typing import Any

from fleetwise.config.paths import config_dir, extra_config_dirs, group_options, search_dirs, user_config_dir
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


# Hydra composes a config in ~0.2 s, most of it building the defaults tree of the group choices
# and merging their files; a value override (`strategy.pp_degree=2`) is then one `OmegaConf.update`.
# Validation diagnoses a bad override by composing again, `strategy=auto` and a sweep's preflight
# compose a candidate each, and all of them differ mostly in values: the composition of the group
# choices is kept per process (keyed by the config files' sizes and mtimes, so an edited tree
# composes again) and each call applies its value overrides to a copy, as Hydra itself does after
# composing (hydra/_internal/config_loader_impl.py `_apply_overrides_to_config`, its `change` case).
_GROUPS_KEPT = 32
_GROUPS: dict[tuple, Any] = {}
# Keys of Hydra's own node that name where a job writes and how it runs, not what is composed:
# values too (the launcher's app sets hydra.run.dir and hydra.mode on every launch)
HYDRA_VALUES = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.mode")
_HYDRA_COMPOSING: list[bool] = []  # non-empty while _compose_groups has Hydra compose


def _split_values(overrides: list[str]) -> tuple[list[str], list[Any], list[Any]]:
    """(overrides Hydra must compose, parsed plain value changes applied after it, every parsed
    override). A value change: no +/~/++ prefix, no package, a dotted key outside hydra.* (or one
    of HYDRA_VALUES), no sweep. Anything else -- or a line that does not parse: Hydra reports it --
    stays with the composition."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - Hydra's composition raises it, as before
        return list(overrides), [], []
    composed, values = [], []
    for text, o in zip(overrides, parsed, strict=True):
        plain = o.type == OverrideType.CHANGE and o.package is None and not o.is_sweep_override()
        own = not o.is_hydra_override() or o.key_or_group in HYDRA_VALUES
        if plain and not _is_group_override(text) and own:
            values.append(o)
        else:
            composed.append(text)
    return composed, values, parsed


def _tree_stamp() -> tuple:
    """Every config file of the search path: (path, size, mtime)."""
    stamp = []
    for base in search_dirs():
        for root, _, files in os.walk(base, followlinks=True):
            for name in files:
                st = os.stat(os.path.join(root, name))
                stamp.append((root, name, st.st_size, st.st_mtime_ns))
    return tuple(stamp)


def _compose_groups(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    key = (tuple(overrides), str(config_dir()), _tree_stamp())
    if key not in _GROUPS:
        running = GlobalHydra.instance().hydra  # a running Hydra app's (the launcher's), kept for it
        GlobalHydra.instance().clear()
        _HYDRA_COMPOSING.append(True)  # kept_app_compositions lets this one through to Hydra
        try:
            with initialize_config_dir(
                config_dir=str(config_dir()), version_base="1.3", job_name="fleetwise"
            ):
                cfg = compose(PRIMARY, overrides=list(overrides), return_hydra_config=True)
        finally:
            _HYDRA_COMPOSING.pop()
            GlobalHydra.instance().clear()
            if running is not None:
                GlobalHydra.instance().initialize(running)
        if len(_GROUPS) >= _GROUPS_KEPT:
            del _GROUPS[next(iter(_GROUPS))]
        _GROUPS[key] = cfg
    return copy.deepcopy(_GROUPS[key])  # a copy: the values below and _to_dict change it


def _compose(overrides: list[str], *, hydra_cfg: bool = False) -> Any:
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    groups, values, parsed = _split_values(list(overrides))
    searchpath = search_path_overrides(overrides)
    cfg = _compose_groups(groups + searchpath)
    for o in values:  # Hydra's messages, word for word: validation explains them (_explain)
        try:
            try:
                OmegaConf.update(cfg, o.key_or_group, o.value(), merge=True)
            except (ConfigAttributeError, ConfigKeyError) as ex:
                raise ConfigCompositionException(
                    f"Could not override '{o.key_or_group}'.\nTo append to your config use +{o.input_line}"
                ) from ex
        except OmegaConfBaseException as ex:
            raise ConfigCompositionException(f"Error merging override {o.input_line}") from ex
    cfg.hydra.runtime.cwd = os.getcwd()  # this call's (the composition's may be another's)
    if values:  # the overrides as Hydra records them, in the given order (the search path last)
        task = [o for o in parsed if not o.is_hydra_override()]
        cfg.hydra.overrides.task = [o.input_line for o in task]
        cfg.hydra.overrides.hydra = [o.input_line for o in parsed if o.is_hydra_override()] + searchpath
        dirname = cfg.hydra.job.config.override_dirname  # Hydra's job.override_dirname, documented
        lines = sorted(o.input_line for o in task if o.key_or_group not in dirname.exclude_keys)
        cfg.hydra.job.override_dirname = dirname.item_sep.join(lines).replace("=", dirname.kv_sep)
    if not hydra_cfg:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


@contextlib.contextmanager
def kept_app_compositions() -> Iterator[None]:
    """Within: a Hydra app's compositions of conf/'s primary config are `_compose`'s (the kept
    group choices, the values applied to a copy) instead of Hydra composing from the files again.
    The launcher's app (launcher/sweeps.py `run_hydra`) composes twice per launch, once for the
    mode and once to run (0.27 s + 0.18 s of a launch's 2.7 s of launcher CPU, measured), after
    preflight composed the same overrides. What _compose cannot do, or refuses, Hydra does as
    before, with its own messages; the result is Hydra's own (tests/unit/config/test_compose_cache.py
    holds it against Hydra's app loader)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    hydras = ConfigLoaderImpl.load_configuration

    def load_configuration(
        self, config_name, overrides, run_mode, from_shell=True, validate_sweep_overrides=True
    ):
        if config_name == PRIMARY and not _HYDRA_COMPOSING:
            try:
                return _compose(list(overrides), hydra_cfg=True)
            except Exception:  # noqa: BLE001 - Hydra says what is wrong, its way
                pass
        return hydras(self, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)

    ConfigLoaderImpl.load_configuration = load_configuration
    try:
        yield
    finally:
        ConfigLoaderImpl.load_configuration = hydras


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
            _compose(accepted + [text], hydra_cfg=True)
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
