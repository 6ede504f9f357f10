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


def group_options(group: str) -> list[str]:
    """Options of a config group, e.g. 'recipe' -> ['ctr/tiny', ..., 'resnet/tiny']."""
    options = set()
    for base in (config_dir(), user_config_dir()):
        root = base / group
        if root.is_dir():
            options.update(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))
    return sorted(options)
