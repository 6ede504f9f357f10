"""Where the Hydra config tree is: conf/ (in the installed package or the checkout), the user's own
tree searched after it, and the options of a config group found in them.

Read by composition (config/compose.py), by the recipe reader (config/recipes.py) and by the
command line's help; it imports nothing of fleetwise, so all of them can.
"""

from __future__ import annotations

import os
from pathlib import Path


def config_dir() -> Path:
    """conf/ inside an installed wheel (fleetwise/conf), else the checkout's conf/."""
    here = Path(__file__).resolve()
    packaged = here.parents[1] / "conf"
    return packaged if packaged.is_dir() else here.parents[3] / "conf"


def user_config_dir() -> Path:
    """A config tree of the user's own, searched after conf/: $FLEETWISE_CONFIG_DIR, else
    ~/.config/fleetwise. `fleetwise calibrate` writes hardware/local.yaml there, so
    `hardware=local` works in a checkout and in an installed wheel alike."""
    env = os.environ.get("FLEETWISE_CONFIG_DIR")
    return Path(env).expanduser() if env else Path.home() / ".config" / "fleetwise"


EXTRA_DIRS_ENV = "FLEETWISE_EXTRA_CONFIG_DIRS"  # set by `--config-dir`; the ranks inherit it


def extra_config_dirs() -> list[Path]:
    """The trees given with `--config-dir DIR` (Hydra's flag): overlaid on conf/ for every command,
    searched after it (a user's recipe/mynet.yaml adds the option recipe=mynet)."""
    return [Path(p) for p in os.environ.get(EXTRA_DIRS_ENV, "").split(os.pathsep) if p]


def search_dirs() -> list[Path]:
    """Every tree config groups are read from: conf/, --config-dir's, then the user's own."""
    return [config_dir(), *extra_config_dirs(), user_config_dir()]


def group_options(group: str) -> list[str]:
    """Options of a config group, e.g. 'recipe' -> ['ctr/tiny', ..., 'resnet/tiny']."""
    options = set()
    for base in search_dirs():
        root = base / group
        if root.is_dir():
            options.update(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))
    return sorted(options)
