"""Real CNNs for spatial tests and benchmarks: torchvision's models (imported without torchvision's
package ``__init__``), a U-Net with skip concatenations and transposed convolutions, and a
CosmoFlow-style 3-D network."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["torchvision_module", "UNet", "cosmoflow"]


def torchvision_module(name: str) -> ModuleType:
    """``torchvision.<name>`` (e.g. ``"models.resnet"``), imported without torchvision's ``__init__``.

    The registry wheel's C++ ops are built against a CUDA torch, so ``import torchvision`` fails with
    the CPU torch at the fake-kernel registrations of those ops. The models are plain Python and never
    call them: registering the installed package directory as an empty ``torchvision`` package lets
    ``torchvision.models.*`` import as usual while the package ``__init__`` never runs. If torchvision
    was already imported normally, that module is used."""
    if sys.modules.get("torchvision") is None:  # not imported, or blocked (None) to keep another import off it
        spec = importlib.machinery.PathFinder.find_spec("torchvision")  # on sys.path, whatever sys.modules says
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("torchvision is not installed (pip install -e '.[dev]')")
        pkg = types.ModuleType("torchvision")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["torchvision"] = pkg
    return importlib.import_module(f"torchvision.{name}")


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    """U-Net (Ronneberger et al.) with `depth` down steps (max pool) from `width` filters, doubling; the
    up steps alternate a 2x2 transposed convolution and a bilinear ``F.interpolate`` followed by a 1x1
    conv, each concatenated with its skip along channels; a 1x1 head gives `classes` per pixel."""

    def __init__(self, in_channels: int = 3, width: int = 16, depth: int = 3, classes: int = 2) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([_block(in_channels, widths[0])] +
                                  [_block(widths[i], widths[i + 1]) for i in range(depth)])
        self.pool = nn.MaxPool2d(2)
        levels = list(reversed(range(depth)))
        self.bilinear = [i % 2 == 1 for i in levels]  # not isinstance: parallelize swaps the module types
        self.up = nn.ModuleList([nn.Conv2d(widths[i + 1], widths[i], 1) if i % 2
                                 else nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2) for i in levels])
        self.merge = nn.ModuleList([_block(2 * widths[i], widths[i]) for i in reversed(range(depth))])
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(self.pool(x) if i else x)
            skips.append(x)
        skips.pop()
        for up, merge, bilinear in zip(self.up, self.merge, self.bilinear):
            if bilinear:
                x = up(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False))
            else:
                x = up(x)
            x = merge(torch.cat([x, skips.pop()], dim=1))
        out: torch.Tensor = self.head(x)
        return out


def cosmoflow(side: int, in_channels: int = 4, widths: tuple[int, ...] = (8, 16), dense: int = 32,
              outputs: int = 4) -> nn.Sequential:
    """CosmoFlow's shape (Mathuriya et al.), scaled by `widths`: per width a conv3d(3)-BN3d-leaky ReLU-
    maxpool(2) block, then flatten and dense layers predicting `outputs` parameters, for cubes of `side`
    (divisible by 2**len(widths)). The flatten redistributes a split volume to whole samples."""
    layers: list[nn.Module] = []
    cin = in_channels
    for cout in widths:
        layers += [nn.Conv3d(cin, cout, 3, 1, 1), nn.BatchNorm3d(cout), nn.LeakyReLU(0.01), nn.MaxPool3d(2)]
        cin = cout
    out = side // 2 ** len(widths)
    layers += [nn.Flatten(), nn.Linear(cin * out**3, dense), nn.LeakyReLU(0.01), nn.Linear(dense, outputs)]
    return nn.Sequential(*layers)
