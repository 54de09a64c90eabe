"""The paper's mesh-tangling model (§VI): six conv-BN-ReLU blocks, a per-pixel prediction conv."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["mesh_model", "mesh_batch", "WIDTHS"]

#: Filters per block. The paper's model is "adapted from VGGNet" without listing them: VGG's doubling at
#: each downsampling, at half VGG's widths (64, 128, 256, 512, 512), so that a 1024^2 training step takes
#: ~2 s on one core. Narrower models are bound by memory bandwidth on small machines (docs/spatial.md).
WIDTHS = (32, 64, 128, 256, 256, 256)


def _block(cin: int, cout: int, convs: int) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for i in range(convs):
        stride = 2 if i == 0 else 1  # downsampling by the first conv of each block
        layers += [nn.Conv2d(cin if i == 0 else cout, cout, 3, stride=stride, padding=1, bias=False),
                   nn.BatchNorm2d(cout), nn.ReLU(inplace=False)]
    return layers


def mesh_model(in_channels: int = 18, widths: Sequence[int] = WIDTHS, convs_per_block: int = 3,
               classes: int = 2) -> nn.Sequential:
    """Fully convolutional: ``len(widths)`` blocks of `convs_per_block` conv(3x3)-BN-ReLU (the first of each
    with stride 2; the paper uses 3 for 1K and 5 for 2K inputs), then a 1x1 conv predicting `classes`
    per output pixel (input side / 2**len(widths))."""
    layers: list[nn.Module] = []
    cin = in_channels
    for w in widths:
        layers += _block(cin, w, convs_per_block)
        cin = w
    layers.append(nn.Conv2d(cin, classes, 1))
    return nn.Sequential(*layers)


def mesh_batch(n: int, size: int, in_channels: int = 18, blocks: int = len(WIDTHS), classes: int = 2,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic (inputs, per-pixel targets) of `n` samples of `size` x `size` (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    out = size
    for _ in range(blocks):
        out = (out - 1) // 2 + 1
    x = torch.randn(n, in_channels, size, size, generator=g)
    y = torch.randint(0, classes, (n, out, out), generator=g)
    return x, y
