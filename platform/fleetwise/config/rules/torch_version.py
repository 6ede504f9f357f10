"""The installed torch against the versions fleetwise was checked on, read without importing torch.

fleetwise runs every feature on torch 2.11 to 2.14 (`SUPPORTED`, pyproject.toml's range): each
version's source was read for the private and version-dependent names fleetwise/compat.py and
fleetwise/dryrun/patches.py use, and `make test-torch` ran its unit tests, one real job per engine
and a pipelined dry run on it (scripts/test_torch.py). Where the two differ between versions, the
doors pick the version's own shape or a public fallback, so nothing here is refused per feature.

- Below the range every job is refused, naming the features this config would use there: each
  goes through torch internals whose older shape was never checked (an AttributeError inside a
  rank, at best), and pip's range says so too, but a cluster image's preinstalled torch passes by
  pip.
- Above the range, a job runs: compat takes torch's public names where it can and raises
  `compat.Unsupported`, naming the version and the feature, where an internal changed. The dry run
  is refused there: it patches torch's internals (dryrun/patches.py), and a silently wrong
  simulation is worse than none.

`importlib.metadata` reads the installed version from the package's metadata in milliseconds
(`import torch` takes seconds, and `config/` never imports torch).
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Iterator

from fleetwise.config.engine import Engine, dp_engine
from fleetwise.config.problems import Problem
from fleetwise.config.rules.context import Context, rule

# The torch minor versions every feature was checked on (compat.TESTED and dryrun/patches.CHECKED
# say the same, and tests/unit/test_torch_version_rule.py holds them and pyproject.toml together).
SUPPORTED = ("2.11", "2.12", "2.13", "2.14")
INSTALL = f"pip install 'torch>={SUPPORTED[0]},<2.{int(SUPPORTED[-1].split('.')[1]) + 1}'"


@functools.cache
def installed_torch() -> str | None:
    """The installed torch's version ("2.11.0+cu130"), or None without one. Read once (the auto
    search checks thousands of candidate configs)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def minor(version: str) -> tuple[int, int]:
    """(2, 11) of "2.11.0+cu130", "2.11", "2.15.0.dev20260101"."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def features(ctx: Context) -> list[str]:
    """What this job would take from torch, named as a user knows it."""
    if ctx.collective is None:
        out = ["the parameter server (torch.distributed.rpc)"]
    else:
        layout, out = ctx.layout, []  # None: a layout that does not resolve (other rules say why)
        if layout is not None and layout.pp > 1:
            out.append("pipeline parallelism (torch.distributed.pipelining's stage internals)")
        if layout is not None and layout.mp > 1:
            out.append("tensor parallelism (DTensor, parallelize_module)")
        engine = dp_engine(layout, ctx.collective.sharding_stage) if layout is not None else None
        out += {
            Engine.ZERO1: ["ZeRO-1 (reduce-scatter and all-gather collectives)"],
            Engine.FSDP: ["FSDP2 (fully_shard)"],
            Engine.DDP: ["DistributedDataParallel"],
        }.get(engine, [])
    if ctx.dryrun:
        out.append("the dry run (fake process group, patched torch internals)")
    return out + ["the live-tensor memory tracker (dispatch modes, storages)"]


@rule
def torch_version(ctx: Context) -> Iterator[Problem]:
    version = installed_torch()
    checked = f"torch {SUPPORTED[0]} to {SUPPORTED[-1]}"
    if version is None:
        if ctx.launching or ctx.dryrun:
            yield Problem("torch", "torch is not installed", f"install it: {INSTALL}")
        return
    if minor(version) < minor(SUPPORTED[0]):
        yield Problem(
            "torch",
            f"the installed torch is {version}; fleetwise was checked on {checked}, and before "
            f"{SUPPORTED[0]} torch's internals that this job's {', '.join(features(ctx))} use differ",
            f"install a checked torch in fleetwise's environment: {INSTALL}",
        )
    elif ctx.dryrun and minor(version) > minor(SUPPORTED[-1]):
        yield Problem(
            "torch",
            f"the installed torch is {version}; the dry run patches torch internals "
            f"(fleetwise/dryrun/patches.py) checked on {checked} only",
            f"dry-run where torch {SUPPORTED[-1]} is installed ({INSTALL}); `fleetwise plan` needs no torch",
        )
