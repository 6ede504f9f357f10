"""What is trained: the `model` config group, one schema per model family.

The schemas live with their families (`fleetwise.families.<name>.schema`); the `model` section is
their union, told apart by the `family` tag, built from the registry (`FAMILIES`) when this module
is imported. The families import only config's leaves (`base`, `problems`), so this import is no
cycle (`fleetwise.families` says more).
"""

from __future__ import annotations

import operator
from functools import reduce
from typing import Annotated

from pydantic import Field

from fleetwise.families import FAMILIES

ModelConfig = Annotated[
    reduce(operator.or_, (f.schema for f in FAMILIES.values())), Field(discriminator="family")
]
