"""Every validation rule: bounds first (limits.py), then the rules across config sections, one
module per section, and the data files a config names (datafiles.py).

A rule takes a `Context` (the config and, when it could be derived, its layout; context.py) and
yields `Problem`s naming the config path, the values and a fix. Every rule runs, so a user sees
every mistake at once; they run in the order their modules are imported below (strategy,
context_parallel, model, moe, train, launch, dryrun, torch_version), which is the order problems are listed in.

    context.py    Context, @rule, RULES; the batch arithmetic rules and `resolve` share
    limits.py     bounds on sizes, names and addresses, checked before every other rule
    strategy.py   degrees, tensor and pipeline parallelism, sharding, the parameter server
    context_parallel.py  strategy.cp_degree: shapes, families, what it does not combine with yet
    model.py      each model family's own shapes
    moe.py        a mixture of experts against the layout and the rest of the config
    train.py      the batch triad, precision, backend, data source, optimizer
    datafiles.py  the data files a config names (token files, image folders and arrays)
    launch.py     launch, fault and checkpoint; the elastic resize of a config
    dryrun.py     what `fleetwise dryrun` cannot simulate
    torch_version.py  the installed torch against the versions fleetwise was checked on
"""

from __future__ import annotations

from fleetwise.config.rules.context import RULES, Context, Rule, rule

# The rule modules register themselves on import, in this order.
# isort: off
from fleetwise.config.rules import strategy, context_parallel, model, moe, train, launch, dryrun, torch_version  # noqa: F401
# isort: on

__all__ = ["RULES", "Context", "Rule", "rule"]
