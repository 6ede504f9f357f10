"""Config: pydantic schemas, Hydra composition and validation. Never imports torch.

Each config group of conf/ has its schema in the module of its name; the root, conf/config.yaml,
and the sections it defines itself are run.py's.

    run.py        RunConfig (the whole job) and config.yaml's own sections: train, launch, run,
                  checkpoint, tracking, fault, plan, auto
    data.py       the `data` group          optim.py     the `optim` group
    model.py      the `model` group (each family's schema, from fleetwise.families)
    strategy.py   the `strategy` group      hardware.py  the `hardware` group
    base.py       Section, the pydantic base of every section
    layout.py     the resolved degrees and all mesh arithmetic (Layout)
    engine.py     which PyTorch mechanism implements a layout's data parallelism
    paths.py      where the config tree is: conf/, the user's own tree, a group's options
    compose.py    Hydra composition, its errors as problems
    recipes.py    what a recipe sets (its strategy's degrees; problems about its values)
    problems.py   Problem(loc, msg, hint) and ConfigError
    validate.py   parse, check (every rule), resolve; load_config; elastic_config
    rules/        every validation rule (rules/__init__.py lists them)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetwise.config.problems import ConfigError, Problem
    from fleetwise.config.run import RunConfig

__all__ = ["ConfigError", "Problem", "RunConfig"]


def __getattr__(name: str):
    # Lazy (PEP 562): the model families import `config.base` and `config.problems` while the
    # `model` schema imports the families, so importing this package must not pull in `run`.
    if name in ("ConfigError", "Problem"):
        from fleetwise.config import problems

        return getattr(problems, name)
    if name == "RunConfig":
        from fleetwise.config.run import RunConfig

        return RunConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
