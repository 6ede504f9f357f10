"""What a run is described by: flattened config params, the git commit, safe tag values."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from fleetwise.tracking.store import MAX_PARAM_VALUE, MAX_TAG_VALUE, clean_key

_TRUNCATED = "...[truncated]"


def flatten_config(d: Mapping, prefix: str = "") -> dict[str, str]:
    """A resolved config as MLflow params: dotted keys (`strategy.pp_degree`), string values.

    Scalars are written as JSON (`true`, `null`, `0.0001`) except strings, which stay as they are;
    lists become JSON strings (`[0, 4, 8]`). Values longer than MLflow's limit (6000 characters)
    are cut and marked, because one oversized value would make MLflow refuse the whole batch.
    Accepts a plain dict, a pydantic model (dumped in JSON mode) or an OmegaConf DictConfig.
    """
    if hasattr(d, "model_dump"):
        d = d.model_dump(mode="json")
    elif type(d).__name__ == "DictConfig":
        from omegaconf import OmegaConf

        d = OmegaConf.to_container(d, resolve=True)
    out: dict[str, str] = {}
    for key, value in d.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, name))
        else:
            out[clean_key(name)] = param_value(value)
    return out


def param_value(value: object) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, Path):
        text = str(value)
    elif isinstance(value, Mapping | Sequence):
        text = json.dumps(_plain(value), default=str)
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = str(value)
    return truncate(text, MAX_PARAM_VALUE)


def _plain(value: object) -> object:
    """Containers (OmegaConf's included) as plain lists/dicts, for json.dumps."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_plain(v) for v in value]
    return value


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - len(_TRUNCATED)] + _TRUNCATED


def error_tag(error: str, limit: int = 5000) -> str:
    """An error message short enough for a tag: its head (what failed) and its tail (the last
    frames of a traceback, where the cause is); the whole text goes to error.txt."""
    error = error.strip()
    if len(error) <= limit:
        return error
    head, tail = limit // 5, limit - limit // 5 - 80
    cut = len(error) - head - tail
    return f"{error[:head]}\n... [{cut} characters cut; the full text is in error.txt] ...\n{error[-tail:]}"


def tag_value(value: object) -> str:
    return truncate(str(value), MAX_TAG_VALUE)


def git_commit(start: Path | None = None) -> str | None:
    """HEAD of the git checkout containing `start` (default: the cwd), or None outside one.

    Looks for a `.git` entry (a directory, or a file in worktrees and submodules) first, so that
    outside a checkout no `git` process is spawned at all.
    """
    here = (start or Path.cwd()).resolve()
    root = next((d for d in (here, *here.parents) if (d / ".git").exists()), None)
    if root is None:
        return None
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = done.stdout.strip()
    return sha if done.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", sha) else None
