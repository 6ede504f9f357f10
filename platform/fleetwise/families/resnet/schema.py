"""ResNet's `model` section and its rules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import Field

from fleetwise.config.base import Section
from fleetwise.config.problems import Problem

MAX_RESNET_BLOCKS = 4096


class ResNetModel(Section):
    """ResNet image classifier (He et al. 2015): stem, four stages of residual blocks, pooling, classifier."""

    family: Literal["resnet"] = "resnet"
    block: Literal["basic", "bottleneck"] = Field("bottleneck", description="Residual block type.")
    layers: list[Annotated[int, Field(ge=1)]] = Field(
        description="Blocks per stage, e.g. [3, 4, 6, 3] for ResNet-50."
    )
    base_width: int = Field(64, ge=1, description="Channels of the first stage (64 in the paper).")
    num_classes: int = Field(1000, ge=2, description="Output classes.")
    image_size: int = Field(224, ge=8, description="Square input resolution.")
    in_channels: int = Field(3, ge=1, description="Input channels.")

    @property
    def num_layers(self) -> int:
        """Residual blocks: the units a pipeline split distributes."""
        return sum(self.layers)


def check(m: ResNetModel) -> Iterator[Problem]:
    if m.image_size < 32:
        yield Problem(
            "model.image_size",
            f"image_size={m.image_size}: ResNet downsamples by 32",
            "use model.image_size >= 32",
        )
    if len(m.layers) != 4:
        yield Problem(
            "model.layers",
            f"{len(m.layers)} stages given; ResNet has 4 (e.g. [3, 4, 6, 3])",
            "give four block counts",
        )


def limits(m: ResNetModel) -> Iterator[Problem]:
    if sum(m.layers) > MAX_RESNET_BLOCKS:
        yield Problem(
            "model.layers",
            f"model.layers has {sum(m.layers):,} blocks, at most {MAX_RESNET_BLOCKS:,} are planned",
            "use fewer blocks per stage",
        )
