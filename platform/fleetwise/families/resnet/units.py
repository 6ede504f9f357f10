"""ResNet image classifier (He et al. 2015): stem, four stages of residual blocks, pooling, classifier."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import Field

from fleetwise.config.base import Section
from fleetwise.config.problems import Problem
from fleetwise.families.base import Family, ModelSpec
from fleetwise.plan.units import Acts, Unit

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


# torchvision layout: convolutions without bias, BatchNorm after each, stride on the 3x3


def _conv_out(size: int, kernel: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - kernel) // stride + 1


def units(m: ResNetModel) -> list[Unit]:
    w, size, cin = m.base_width, m.image_size, m.in_channels
    expansion = 4 if m.block == "bottleneck" else 1
    units: list[Unit] = []

    # Stem: conv 7x7/2, BN, ReLU, maxpool 3x3/2.
    s1 = _conv_out(size, 7, 2, 3)
    s2 = _conv_out(s1, 3, 2, 1)
    units.append(
        Unit(
            "stem",
            "embedding",
            params_whole=49 * cin * w + 2 * w,
            fwd_flops=2 * 49 * cin * w * s1 * s1,
            # input image, conv output (BN input), ReLU output (maxpool input); maxpool indices (int64 = 2)
            acts={"none": Acts(whole=cin * size * size + 2 * w * s1 * s1 + 2 * w * s2 * s2)},
            boundary_elements=w * s2 * s2,
            fwd_ops=7,  # conv, BN (3 ops), ReLU (+ detach), max-pool
            fwd_gemms=1,
            fwd_elementwise=2 * w * s1 * s1 + 2 * w * s2 * s2,  # BN, ReLU, max-pool and its indices
            param_tensors=3,  # conv, BN weight and bias
            fwd_convs=1,
            largest_whole=49 * cin * w,
        )
    )
    inplanes, spatial = w, s2
    for stage, blocks in enumerate(m.layers):
        planes = w * 2**stage
        for i in range(blocks):
            stride = 2 if (stage > 0 and i == 0) else 1
            out = _conv_out(spatial, 3, stride, 1)
            down = stride != 1 or inplanes != planes * expansion
            if m.block == "basic":
                params = 9 * inplanes * planes + 9 * planes * planes + 4 * planes
                flops = 2 * 9 * (inplanes * planes + planes * planes) * out * out
                saved = 4 * planes * out * out  # conv1 out, ReLU1 out, conv2 out, block output
                convs = 2
                largest = 9 * max(inplanes, planes) * planes
                # BN and ReLU after each conv, the residual add
                elementwise = 5 * planes * out * out
            else:
                params = inplanes * planes + 9 * planes * planes + 4 * planes * planes + 2 * planes * 6
                flops = 2 * (
                    inplanes * planes * spatial * spatial
                    + 9 * planes * planes * out * out
                    + 4 * planes * planes * out * out
                )
                saved = 2 * planes * spatial * spatial + 2 * planes * out * out + 8 * planes * out * out
                convs = 3
                largest = max(inplanes * planes, 9 * planes * planes, expansion * planes * planes)
                elementwise = 2 * planes * spatial * spatial + 14 * planes * out * out
            # conv 1, BN 3 (counter, buffer, norm) and ReLU 2 (+ detach) ops each; residual add:
            # basic 2 conv+BN, 2 ReLU; bottleneck 3 conv+BN, 3 ReLU
            ops = 2 * 4 + 2 * 2 + 1 if m.block == "basic" else 3 * 4 + 3 * 2 + 1
            if down:
                ops += 4  # 1x1 conv + BN
                params += inplanes * planes * expansion + 2 * planes * expansion
                flops += 2 * inplanes * planes * expansion * out * out
                saved += planes * expansion * out * out
                convs += 1
                largest = max(largest, inplanes * planes * expansion)
                elementwise += planes * expansion * out * out
            units.append(
                Unit(
                    f"layer{stage + 1}.{i}",
                    "block",
                    params_whole=params,
                    fwd_flops=flops,
                    acts={
                        "none": Acts(whole=saved),
                        "selective": Acts(whole=saved),
                        "full": Acts(whole=inplanes * spatial * spatial),
                    },
                    boundary_elements=planes * expansion * out * out,
                    fwd_ops=ops,
                    fwd_gemms=convs,
                    fwd_elementwise=elementwise,
                    param_tensors=3 * convs,  # each conv and its BN's weight and bias
                    fwd_convs=convs,
                    largest_whole=largest,
                )
            )
            inplanes, spatial = planes * expansion, out
    units.append(
        Unit(
            "head",
            "head",
            params_whole=inplanes * m.num_classes + m.num_classes,
            fwd_flops=2 * inplanes * m.num_classes,
            acts={"none": Acts(whole=inplanes * spatial * spatial + inplanes + m.num_classes)},
            transient=Acts(whole=2 * m.num_classes),
            fwd_ops=7,  # avg-pool, flatten, linear (t, addmm), log-softmax, NLL
            fwd_gemms=1,
            fwd_elementwise=inplanes + m.num_classes,  # pooled features, log-softmax
            param_tensors=2,
            largest_whole=inplanes * m.num_classes,
        )
    )
    return units


def input_bytes(m: ResNetModel) -> int:
    return 4 * m.in_channels * m.image_size**2 + 8  # fp32 image, int64 label


def data_profile(m: ResNetModel, _d) -> dict:
    return {"num_classes": m.num_classes, "image_size": m.image_size, "in_channels": m.in_channels}


def spec(_: ResNetModel) -> ModelSpec:
    from fleetwise.models.resnet import ResNet, classification_loss

    return ModelSpec(ResNet, classification_loss, ("images",))


def source(m: ResNetModel, d):
    from fleetwise.data.images import ImageArray, ImageFolder, SyntheticImages

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
