"""Real CNNs for spatial tests and benchmarks: torchvision's models (imported without torchvision's
package ``__init__``) and the conformance set built from them (:data:`CLASSIFIERS`, :data:`VIDEO`,
:data:`DETECTION`, :data:`SEGMENTATION`), a U-Net with skip concatenations and transposed convolutions,
and a CosmoFlow-style 3-D network."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["torchvision_module", "UNet", "cosmoflow", "CLASSIFIERS", "VIDEO", "DETECTION", "SEGMENTATION",
           "IGNORE", "segmentation_criterion", "no_dropout", "suite_grids", "swin"]


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


# --- the conformance set: torchvision's classifiers and video models ---------------------------------
# Built by torchvision's own constructors; where the stock widths make a float64 test costly, from the
# model's own building blocks and stage tables at smaller widths (every block type kept).

def _vgg11_bn() -> nn.Module:
    model: nn.Module = torchvision_module("models.vgg").vgg11_bn(num_classes=10)
    # the stock head is 120M parameters; a small one keeps the 7x7 adaptive pool, flatten and linears
    model.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, 16), nn.ReLU(True), nn.Linear(16, 10))
    return model


def _convnext() -> nn.Module:
    """ConvNeXt's blocks (depthwise 7x7, channels-last LayerNorm and MLP, layer scale) at small widths."""
    convnext = torchvision_module("models.convnext")
    cfg = convnext.CNBlockConfig
    model: nn.Module = convnext.ConvNeXt([cfg(8, 16, 1), cfg(16, 32, 1), cfg(32, 64, 1), cfg(64, None, 1)],
                                         num_classes=10)
    return model


def _regnet() -> nn.Module:
    """RegNet's X blocks (grouped bottlenecks) at small widths."""
    regnet = torchvision_module("models.regnet")
    params = regnet.BlockParams.from_init_params(depth=4, w_0=8, w_a=8.0, w_m=2.0, group_width=8)
    model: nn.Module = regnet.RegNet(params, num_classes=10)
    return model


def _efficientnet() -> nn.Module:
    """EfficientNet-B0's stage table (MBConv with squeeze-and-excitation, SiLU, stochastic depth) at width
    0.25 and depth 0.5."""
    effnet = torchvision_module("models.efficientnet")

    def stage(*args: int) -> object:
        return effnet.MBConvConfig(*args, width_mult=0.25, depth_mult=0.5)
    table = [stage(1, 3, 1, 32, 16, 1), stage(6, 3, 2, 16, 24, 2), stage(6, 5, 2, 24, 40, 2),
             stage(6, 3, 2, 40, 80, 3), stage(6, 5, 1, 80, 112, 3), stage(6, 5, 2, 112, 192, 4),
             stage(6, 3, 1, 192, 320, 1)]
    model: nn.Module = effnet.EfficientNet(table, dropout=0.2, num_classes=10)
    return model


def swin() -> nn.Module:
    """torchvision's SwinTransformer (shifted-window attention, padded windows, patch merging) at small
    sizes: patch 4, embed 16, depths (1, 1), heads (1, 2), window 4; inputs N x 3 x H x W."""
    model: nn.Module = torchvision_module("models.swin_transformer").SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=[4, 4], num_classes=10)
    return model


def _tv(module: str, fn: str, **kwargs: object) -> Callable[[], nn.Module]:
    return lambda: getattr(torchvision_module(module), fn)(num_classes=10, **kwargs)


#: Image classifiers of the conformance set (10 classes; inputs N x 3 x H x W, H and W >= 2 x 32 x grid).
CLASSIFIERS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": _tv("models.resnet", "resnet18"),
    "resnet50": _tv("models.resnet", "resnet50"),
    "mobilenet_v2": _tv("models.mobilenetv2", "mobilenet_v2"),
    "densenet": lambda: torchvision_module("models.densenet").DenseNet(
        growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16, bn_size=2, num_classes=10),
    "vgg11_bn": _vgg11_bn,
    "shufflenet_v2": _tv("models.shufflenetv2", "shufflenet_v2_x0_5"),
    "mobilenet_v3": _tv("models.mobilenetv3", "mobilenet_v3_small"),
    "efficientnet": _efficientnet,
    "convnext": _convnext,
    "regnet": _regnet,
    "squeezenet": _tv("models.squeezenet", "squeezenet1_1"),
    "mnasnet": _tv("models.mnasnet", "mnasnet0_5"),
}

#: Video classifiers of the conformance set (10 classes; clips N x 3 x T x H x W on a 3-D grid).
VIDEO: dict[str, Callable[[], nn.Module]] = {name: _tv("models.video.resnet", name)
                                             for name in ("mc3_18", "r3d_18", "r2plus1d_18")}


def _resnet_fpn() -> nn.Module:
    """torchvision's ResNet-FPN detection backbone on ResNet-18 (FrozenBatchNorm, layers 2-4 trainable,
    the extra max-pooled level): a dict of five feature maps."""
    backbone: nn.Module = torchvision_module("models.detection.backbone_utils").resnet_fpn_backbone(
        backbone_name="resnet18", weights=None)
    return backbone


def _mobilenet_fpn() -> nn.Module:
    """The backbone of torchvision's ``fasterrcnn_mobilenet_v3_large_fpn`` (untrained: BatchNorm, every
    layer trainable): MobileNetV3-large features and an FPN, a dict of three feature maps."""
    detector = torchvision_module("models.detection.faster_rcnn").fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=10)
    backbone: nn.Module = detector.backbone
    return backbone


#: Detection backbones of the conformance set (inputs N x 3 x H x W with H, W >= 64 x grid: their
#: extra level pools the 1/32 map once more).
DETECTION: dict[str, Callable[[], nn.Module]] = {"resnet18_fpn": _resnet_fpn, "mobilenet_v3_fpn": _mobilenet_fpn}


def _segmentation(name: str) -> Callable[[], nn.Module]:
    # torchvision's defaults (aux_loss too), random weights, no download; 3 classes keeps the heads small
    return lambda: getattr(torchvision_module("models.segmentation"), name)(weights=None, weights_backbone=None,
                                                                            num_classes=3)


#: Segmentation models of the conformance set (3 classes; inputs N x 3 x H x W, dense targets N x H x W
#: with :data:`IGNORE` pixels; loss :func:`segmentation_criterion`).
SEGMENTATION: dict[str, Callable[[], nn.Module]] = {
    name: _segmentation(name) for name in ("lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large",
                                           "fcn_resnet50", "deeplabv3_resnet50")}
IGNORE = 255


def segmentation_criterion(inputs: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """torchvision's references/segmentation/train.py criterion, as written there."""
    losses = {name: F.cross_entropy(x, target, ignore_index=IGNORE) for name, x in inputs.items()}
    return losses["out"] if len(losses) == 1 else losses["out"] + 0.5 * losses["aux"]


def no_dropout(model: nn.Module) -> nn.Module:
    """`model` with its dropout and stochastic depth probabilities set to 0 (in place), for comparisons
    with one process: random masks (and dropped residual rows) differ between one process and a split run."""
    for m in model.modules():
        if isinstance(m, nn.Dropout) or type(m).__name__ == "StochasticDepth":
            m.p = 0.0  # type: ignore[assignment]
    return model


def suite_grids(size: int, video: bool = False) -> list[tuple[tuple[int, ...], int]]:
    """The (grid, samples) layouts the conformance set runs on `size` ranks: 2x1 and 1x2; 3x1; 2x2 and the
    sample x spatial hybrids 2x1 x 2 and 1x2 x 2. Video: 1x2x1; 1x3x1; 1x2x2 and 1x2x1 x 2 (short clips
    keep their frames whole)."""
    if video:
        volumes: dict[int, list[tuple[tuple[int, ...], int]]] = {
            2: [((1, 2, 1), 1)], 3: [((1, 3, 1), 1)], 4: [((1, 2, 2), 1), ((1, 2, 1), 2)]}
        return volumes.get(size, [])
    images: dict[int, list[tuple[tuple[int, ...], int]]] = {
        2: [((2, 1), 1), ((1, 2), 1)], 3: [((3, 1), 1)], 4: [((2, 2), 1), ((2, 1), 2), ((1, 2), 2)]}
    return images.get(size, [])
