"""ResNet (He et al. 2015) in torchvision's layout: 3x3 stride on the bottleneck's middle conv
("ResNet v1.5"), BatchNorm after every conv, zero-initialised last BN of each residual branch
off (plain init), so parameter names and counts match torchvision's resnet50/101.

The residual blocks of all four stages are flattened into one ModuleDict (`layers`), which is
what pipeline parallelism splits; the stem and the classifier head go with the first and last
stage.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fleetwise.families.resnet.schema import ResNetModel


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = conv3x3(cin, planes, stride), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = conv3x3(planes, planes), nn.BatchNorm2d(planes)
        self.downsample = _downsample(cin, planes, stride, self.expansion)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (self.downsample(x) if self.downsample is not None else x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = conv1x1(cin, planes), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = conv3x3(planes, planes, stride), nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = conv1x1(planes, planes * 4), nn.BatchNorm2d(planes * 4)
        self.downsample = _downsample(cin, planes, stride, self.expansion)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (self.downsample(x) if self.downsample is not None else x))


def _downsample(cin: int, planes: int, stride: int, expansion: int) -> nn.Module | None:
    if stride == 1 and cin == planes * expansion:
        return None
    return nn.Sequential(conv1x1(cin, planes * expansion, stride), nn.BatchNorm2d(planes * expansion))


def resnet_rule(mname: str, module: nn.Module, attr: str, shape, g: torch.Generator) -> torch.Tensor:
    """torchvision's ResNet init: Kaiming-normal (fan_out, ReLU) convolutions, BatchNorm ones/zeros
    (running variance ones), and torch's default U(±1/sqrt(fan_in)) for the classifier."""
    if isinstance(module, nn.Conv2d):
        fan_out = shape[0] * math.prod(shape[2:])
        return torch.randn(shape, generator=g) * math.sqrt(2.0 / fan_out)
    if isinstance(module, nn.Linear):
        bound = 1.0 / math.sqrt(module.in_features)
        return torch.rand(shape, generator=g) * 2 * bound - bound
    if attr in ("weight", "running_var"):
        return torch.ones(shape)
    if attr == "num_batches_tracked":
        return torch.zeros(shape, dtype=torch.long)
    return torch.zeros(shape)


class ResNet(nn.Module):
    # the model contract (fleetwise.models.contract): blocks in `layers`, the ends named here
    first_modules = ("stem",)
    last_modules = ("head",)

    def __init__(self, cfg: ResNetModel):
        super().__init__()
        self.cfg = cfg
        block = Bottleneck if cfg.block == "bottleneck" else BasicBlock
        w = cfg.base_width
        self.stem: nn.Module | None = nn.Sequential(
            nn.Conv2d(cfg.in_channels, w, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        layers, cin = {}, w
        for stage, blocks in enumerate(cfg.layers):
            planes = w * 2**stage
            for i in range(blocks):
                layers[str(len(layers))] = block(cin, planes, 2 if (stage > 0 and i == 0) else 1)
                cin = planes * block.expansion
        self.layers = nn.ModuleDict(layers)
        self.head: nn.Module | None = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, cfg.num_classes)
        )
        # initial values: fleetwise.models.init (drawn per parameter, after sharding)
        self.init_rule = resnet_rule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x) if self.stem is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.head is not None else h


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)
