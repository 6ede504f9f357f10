"""ResNet as a chain of planner units: the stem, one unit per residual block, the head (pooling,
classifier, the loss)."""

from __future__ import annotations

from fleetwise.families.resnet.schema import ResNetModel
from fleetwise.plan.units import Acts, Unit

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
