"""ResNet image classifier (He et al. 2015): stem, four stages of residual blocks, pooling, classifier.

The family in one package: `schema` (the `model` section and its rules), `units` (the planner's
view), `model` (the nn.Module and its init rule), `data` (image sources). It has no tensor-parallel
plan. The rank-side parts are imported when a rank asks for them (`spec`, `source`), so importing
this package never imports torch.
"""

from __future__ import annotations

import math

from fleetwise.families.record import Family, ModelSpec
from fleetwise.families.resnet.schema import ResNetModel, check, limits
from fleetwise.families.resnet.units import input_bytes, units


def data_profile(m: ResNetModel, _d) -> dict:
    return {"num_classes": m.num_classes, "image_size": m.image_size, "in_channels": m.in_channels}


def spec(_: ResNetModel) -> ModelSpec:
    from fleetwise.families.resnet.model import ResNet, classification_loss

    return ModelSpec(ResNet, classification_loss, ("images",))


def source(m: ResNetModel, d):
    from fleetwise.families.resnet.data import ImageArray, ImageFolder, SyntheticImages

    if d.source == "bundled":
        from fleetwise.data.bundled import BundledDigits

        return BundledDigits(m.image_size, m.in_channels)
    if d.source == "image_array":
        return ImageArray(d.path)
    if d.source == "image_folder":
        return ImageFolder(d.path, m.image_size)
    return SyntheticImages(m.num_classes, m.image_size, m.in_channels, d.seed, d.num_samples)


FAMILY = Family(
    name="resnet",
    schema=ResNetModel,
    units=units,
    input_bytes=input_bytes,
    spec=spec,
    source=source,
    check=check,
    limits=limits,
    data_sources=("bundled", "image_folder", "image_array"),
    data_profile=data_profile,
    no_tensor_parallel=(
        "convolutions are not split by fleetwise",
        "set strategy.mp_degree=1 and use dp or sharding",
    ),
    convolutional=True,
    chance_loss=lambda m: math.log(m.num_classes),
)
