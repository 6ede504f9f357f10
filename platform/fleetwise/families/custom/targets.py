"""The `_target_`s of a custom model and dataset: imported and checked without being called.

What `validate` does with a user's `_target_` (issue 44 item 6): it imports the module that names
it (importing runs that module's top-level code, as `python -c "import mypkg.net"` would) and
checks that the name exists, is the kind of thing it should be (an nn.Module / Dataset class or a
function returning one) and accepts the keyword arguments the config gives (`inspect.signature`,
no call). Building the module happens only on the `meta` device, for the trace that derives the
planner units (families/custom/derive.py), and in the ranks.

A recipe from elsewhere is code, like a script. `fleetwise validate` imports only what a recipe
names inside its own project (the `--config-dir` tree and the folder holding it), fleetwise,
torch and transformers: a `_target_` in any other module is listed in a notice (`foreign_targets`,
found without importing anything) and held back (`holding`): its checks are skipped, and `plan` or
`train` import it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fleetwise.config.problems import Problem

HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")
TRUSTED_PACKAGES = ("fleetwise", "torch", "transformers")
_HELD: set[str] = set()  # targets this process must not import now (see `holding`)


def targets_in(node: Any, loc: str) -> list[tuple[str, str]]:
    """(config path, dotted target) of every `_target_` under `node`, nested ones included (Hydra
    instantiates those too)."""
    found = []
    if isinstance(node, dict):
        if isinstance(node.get("_target_"), str):
            found.append((f"{loc}._target_", node["_target_"]))
        for k, v in node.items():
            found += targets_in(v, f"{loc}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += targets_in(v, f"{loc}.{i}")
    return found


def module_file(path: str) -> Path | None:
    """The file of the module a dotted target lives in, found on sys.path (and the working directory)
    by name alone: nothing is imported, not even its parent packages (importlib.util.find_spec would
    run their __init__). None when no such file is found."""
    parts = path.split(".")
    roots = [Path(p or os.getcwd()) for p in [*sys.path, os.getcwd()]]
    for root in roots:
        base = root / parts[0]
        if not (base.is_dir() or base.with_suffix(".py").is_file()):
            continue
        for i in range(len(parts) - 1, 0, -1):  # the longest module prefix: pkg.mod.Class.method
            stem = root.joinpath(*parts[:i])
            for candidate in (stem.with_suffix(".py"), stem / "__init__.py"):
                if candidate.is_file():
                    return candidate.resolve()
    return None


def project_dirs() -> list[Path]:
    """Where a recipe's own code may live: each `--config-dir` tree and the folder holding it
    (examples/mynet/my_conf -> examples/mynet, beside mynet/net.py), and the user's config tree."""
    from fleetwise.config.paths import extra_config_dirs, user_config_dir

    dirs = []
    for tree in extra_config_dirs():
        tree = tree.resolve()
        dirs += [tree, tree.parent]
    return [*dirs, user_config_dir().resolve()]


def foreign_targets(sections: dict[str, Any]) -> list[tuple[str, str, Path | None]]:
    """(config path, target, its module's file) of each `_target_` in `sections` ({"model": ...,
    "data": ...}) outside the recipe's project, fleetwise, torch and transformers."""
    ensure_cwd_importable()
    mine = project_dirs()
    out = []
    for name, node in sections.items():
        for loc, target in targets_in(node, name):
            if target.split(".")[0] in TRUSTED_PACKAGES:
                continue
            where = module_file(target)
            if where is not None and any(where.is_relative_to(d) for d in mine):
                continue
            out.append((loc, target, where))
    return out


@contextlib.contextmanager
def holding(targets: list[str]) -> Iterator[None]:
    """Within: the custom family neither imports nor builds a model or dataset naming `targets`
    (derive.py reports it unchecked)."""
    _HELD.update(targets)
    try:
        yield
    finally:
        _HELD.difference_update(targets)


def holding_any() -> bool:
    return bool(_HELD)


def held(sections: dict[str, Any]) -> list[str]:
    """The targets of `sections` that are held back now."""
    return [t for name, node in sections.items() for _, t in targets_in(node, name) if t in _HELD]


def ensure_cwd_importable() -> None:
    """A user's package imports from the working directory (like `python -m`), on every rank."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def locate(path: str) -> Any:
    """The object `pkg.mod.name` names (import the longest importable module prefix, then getattr)."""
    ensure_cwd_importable()
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
                continue  # this prefix is no module: try a shorter one (`pkg.mod.Class.method`)
            raise  # the module exists but imports something missing
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(f"No module named {parts[0]!r}", name=parts[0])


def target_problems(loc: str, node: Any, kind: str) -> tuple[Any, list[Problem]]:
    """(the located target or None, problems) for the config node at `loc` (a dict with `_target_`).
    kind: "module" (an nn.Module), "dataset" (a torch Dataset) or "loss" (a callable)."""
    example = {"module": "mypkg.net.Net", "dataset": "mypkg.data.make_dataset", "loss": "mypkg.net.loss"}[
        kind
    ]
    if not isinstance(node, dict) or not isinstance(node.get("_target_"), str) or not node["_target_"]:
        return None, [
            Problem(
                loc,
                f"{loc} is {node!r}: it needs `_target_`, the dotted path of your "
                f"{'class or function' if kind != 'loss' else 'loss function'}",
                f"set {loc}._target_={example} (and its keyword arguments beside it)",
            )
        ]
    path = node["_target_"]
    try:
        obj = locate(path)
    except Exception as err:  # noqa: BLE001 - any import error is the user's, reported with its text
        return None, [
            Problem(
                f"{loc}._target_",
                f"{path} does not import: {type(err).__name__}: {err}",
                "check the spelling, and that its package is importable from the working directory "
                "or PYTHONPATH on every node",
            )
        ]
    problems = _kind_problems(loc, path, obj, kind)
    if not problems:
        problems = _kwargs_problems(loc, path, obj, node, kind)
    return (obj if not problems else None), problems


def _kind_problems(loc: str, path: str, obj: Any, kind: str) -> list[Problem]:
    from torch import nn
    from torch.utils.data import Dataset

    want = {"module": nn.Module, "dataset": Dataset}.get(kind)
    shown = {"module": "torch.nn.Module", "dataset": "torch.utils.data.Dataset"}.get(kind, "")
    if want is None:
        ok = callable(obj)
        what = "a callable (output, label) -> scalar"
    elif inspect.isclass(obj):
        ok = issubclass(obj, want)
        what = f"a {shown} subclass, or a function returning one"
    else:
        ok = callable(obj)  # a factory: what it returns is checked when it is built
        what = f"a {shown} class or a function returning one"
    if ok:
        return []
    return [
        Problem(
            f"{loc}._target_",
            f"{path} is a {type(obj).__name__ if not inspect.isclass(obj) else obj.__qualname__}, not {what}",
            f"point {loc}._target_ at {what}",
        )
    ]


def _kwargs_problems(loc: str, path: str, obj: Any, node: dict, kind: str) -> list[Problem]:
    kwargs = {k: v for k, v in node.items() if k not in HYDRA_KEYS}
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: its call will say
        return []
    if kind == "loss" and node.get("_partial_"):
        # a partial: called later with (output, label) before the configured keywords
        try:
            sig.bind_partial(**kwargs)
        except TypeError as err:
            return [_reject(loc, path, sig, err)]
        return []
    try:
        sig.bind(**kwargs)
    except TypeError as err:
        return [_reject(loc, path, sig, err)]
    return []


def _reject(loc: str, path: str, sig: inspect.Signature, err: TypeError) -> Problem:
    return Problem(
        loc,
        f"{path}{sig} rejects the configured arguments: {err}",
        f"give {loc} exactly the keyword arguments {path.rsplit('.', 1)[-1]} takes",
    )
