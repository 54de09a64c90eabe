"""The conformance set: torchvision's classifiers (ResNet-18/50, MobileNetV2/V3, DenseNet, VGG-11-BN,
ShuffleNetV2, EfficientNet, ConvNeXt, RegNet, SqueezeNet, MNASNet) and video ResNets (through
``fit(strategy="spatial")`` on 3-D grids) train spatially exactly as in one process: parameters after 2
SGD steps in float64 on every grid and sample x spatial hybrid, with no activation redistributed (only
pooled vectors move). So do torchvision's segmentation models (FCN-ResNet50, DeepLabV3-MobileNetV3,
LR-ASPP-MobileNetV3, their default heads) under fit's criterion with ignored pixels, the loss computed on
blocks (dense targets laid out like the output)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from mpitrain.fit import fit
from mpitrain.spatial import Distribution, models
from mpitrain.spatial.models import CLASSIFIERS, DETECTION, VIDEO, no_dropout, suite_grids, swin, torchvision_module
from mpitrain.spatial.tensor import SpatialError
from mpitrain.spatial.trainer import SpatialTrainer
from tests.helpers import assert_all_ranks

pytestmark = pytest.mark.mpi
STEPS, RTOL = 2, 1e-9


def layouts(size: int, index: int) -> list[tuple[tuple[int, ...], int]]:
    """The set's layouts (`suite_grids`): 2 ranks 2x1 and 1x2; 3 ranks 3x1; 4 ranks 2x2 and one sample x
    spatial hybrid (2x1 or 1x2 by model `index`, so the suite covers both)."""
    grids = suite_grids(size)
    return grids[:2] if size != 4 else [grids[0], grids[1 + index % 2]]


MODELS = CLASSIFIERS


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def _reference_update(comm, model: nn.Module, batches, loss_fn) -> torch.Tensor:
    """The parameter update of `STEPS` SGD steps in one process (computed on rank 0, sent to all)."""
    ref = copy.deepcopy(model)
    model_device = next(model.parameters()).device
    if comm.rank == 0:
        opt = sgd(ref.parameters())
        for x, y in batches:
            opt.zero_grad()
            loss_fn(ref(x.to(model_device)), y.to(model_device)).backward()
            opt.step()
    return comm.broadcast(_flat(ref) - _flat(model), 0)


#: 3 ranks (3x1, uneven blocks) run these; 2 and 4 ranks run every model.
AT_3 = ("resnet18", "densenet", "shufflenet_v2", "convnext", "regnet", "squeezenet")


def _batches(shape: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(shape, dtype=torch.float64, generator=g), torch.randint(0, 10, (shape[0],), generator=g))
            for _ in range(STEPS)]


def check_update(comm, name: str, model: nn.Module, batches, loss_fn, grids, via_fit: bool = False) -> None:
    """`model`'s parameter update after `STEPS` SGD-momentum steps on every (grid, samples) of `grids`
    (SpatialTrainer, or ``fit(strategy="spatial")``) is one process's within `RTOL`, with no activation
    redistributed (counted by the distribution; through fit, by its warnings)."""
    start = _flat(model)
    expected = _reference_update(comm, model, batches, loss_fn)
    for grid, samples in grids:
        if via_fit:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RuntimeWarning)
                trained = fit(copy.deepcopy(model), batches, loss_fn, sgd, strategy="spatial", grid=grid,
                              samples=samples, progress=False).model
            moves: object = [str(w.message) for w in caught if "not a spatial op" in str(w.message)]
        else:
            trainer = SpatialTrainer(copy.deepcopy(model), loss_fn, sgd, Distribution(comm, grid, samples))
            for x, y in batches:
                trainer.train_step(x, y)
            trained, moves = trainer.model, trainer.dist.redistributions
        gap = float((_flat(trained) - start - expected).norm() / expected.norm())
        assert_all_ranks(comm, gap < RTOL and not moves,
                         f"{name} grid {grid} x{samples}: relative update gap {gap:.3g}, redistributed {moves}")


#: The segmentation models the suite runs (DeepLabV3-ResNet50, 40M float64 parameters, runs in the bench).
SEGMENTATION = {name: models.SEGMENTATION[name]
                for name in ("fcn_resnet50", "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large")}
IGNORE, criterion = models.IGNORE, models.segmentation_criterion


def segmentation_layout(size: int, index: int) -> tuple[tuple[int, int], int]:
    """One (grid, samples) per world size, rotating by model `index`: 2 ranks 2x1 or 1x2, 3 ranks 3x1,
    4 ranks the sample x spatial hybrid 2 x (2x1) or 2 x (1x2)."""
    return {2: [((2, 1), 1), ((1, 2), 1)][index % 2], 3: ((3, 1), 1), 4: [((2, 1), 2), ((1, 2), 2)][index % 2]}[size]


@pytest.mark.parametrize("name", list(SEGMENTATION))
def test_torchvision_segmentation_model_trains_as_one_process_with_ignored_pixels(comm, name):
    torch.manual_seed(0)
    model = no_dropout(SEGMENTATION[name]().double())
    start = _flat(model)
    g = torch.Generator().manual_seed(1)
    # the deepest feature map (1/8 for FCN, 1/16 for MobileNetV3) must give every grid row a cell
    shape = (2, 3, 48 if comm.size == 3 else 32, 32)
    batches = []
    for _ in range(STEPS):
        target = torch.randint(0, 3, (shape[0], *shape[2:]), generator=g)
        target[0, : shape[2] // 3] = IGNORE  # ignored pixels, more in some blocks and samples than others
        target[1, :, -5:] = IGNORE
        batches.append((torch.randn(shape, dtype=torch.float64, generator=g), target))
    expected = _reference_update(comm, model, batches, criterion)
    grid, samples = segmentation_layout(comm.size, list(SEGMENTATION).index(name))
    trainer = SpatialTrainer(copy.deepcopy(model), criterion, sgd, Distribution(comm, grid, samples))
    for x, y in batches:
        trainer.train_step(x, y)
    gap = float(((_flat(trainer.model) - start) - expected).norm() / expected.norm())
    moves, blocks = trainer.dist.redistributions, trainer.step_loss.on_blocks
    assert_all_ranks(comm, gap < RTOL and not moves and blocks,
                     f"{name} grid {grid} x{samples}: relative update gap {gap:.3g}, redistributed {moves}, "
                     f"loss on blocks {blocks}")


@pytest.mark.parametrize("name", list(MODELS))
def test_torchvision_model_trains_as_one_process_on_every_grid(comm, device, name):
    """On `device` (the CPU here; the GPU suite runs this test again on CUDA: tests/gpu)."""
    if comm.size == 3 and name not in AT_3:  # the same verdict on every rank
        pytest.skip("3 ranks (3x1, uneven blocks) run the cheaper models only; 2 and 4 ranks run all")
    torch.manual_seed(0)
    model = no_dropout(MODELS[name]().double()).to(device)
    # 64x64 (96x64 on 3 ranks): the last feature map (1/32) covers every grid with 2x2 cells or more
    batches = _batches((2, 3, 96 if comm.size == 3 else 64, 64))
    check_update(comm, name, model, batches, nn.CrossEntropyLoss(),
                 layouts(comm.size, list(MODELS).index(name)))


# r3d_18 and r2plus1d_18 (31-33M parameters: ~28 s each at 2 ranks) run in `mpitrain bench spatial_models
# --video` (docs/spatial.md's table); the suite runs mc3_18 (11M, the same blocks) at every size.
@pytest.mark.parametrize("name", ["mc3_18"])
def test_torchvision_video_model_trains_through_fit_on_a_3d_grid_as_one_process(comm, name):
    torch.manual_seed(0)
    model = VIDEO[name]().double()
    # clips N x C x T x H x W: layer4 maps 32 (48 on 3 ranks) rows to 2 (3), one or more per rank
    batches = _batches((2, 3, 2, 48 if comm.size == 3 else 32, 32))
    check_update(comm, name, model, batches, nn.CrossEntropyLoss(), suite_grids(comm.size, video=True), via_fit=True)


def _googlenet_loss(out, y: torch.Tensor) -> torch.Tensor:
    """torchvision's recipe for GoogLeNet in training mode: the logits' loss plus 0.3 of each auxiliary's."""
    ce = nn.functional.cross_entropy
    return ce(out.logits, y) + 0.3 * (ce(out.aux_logits1, y) + ce(out.aux_logits2, y))


def _features_loss(out: dict, y: torch.Tensor) -> torch.Tensor:
    """A mean over rows: each sample's mean squared feature, summed over the FPN's levels, times its target."""
    terms = [((v * v).mean((1, 2, 3)) * y.double()).mean() for v in out.values()]
    return torch.stack(terms).sum()


#: Models whose output is a namedtuple or a dict of blocks: (builder, loss, input side, at 3 ranks).
MULTI_OUTPUT = {
    "googlenet_aux": (lambda: torchvision_module("models.googlenet").googlenet(num_classes=10, init_weights=True),
                      _googlenet_loss, 64, 96),
    **{name: (build, _features_loss, 128, 192) for name, build in DETECTION.items()},
}


@pytest.mark.parametrize("name", list(MULTI_OUTPUT))
def test_models_with_tuple_or_dict_outputs_train_as_one_process(comm, name):
    if {"resnet18_fpn": 2, "mobilenet_v3_fpn": 4}.get(name, comm.size) != comm.size:
        pytest.skip("GoogLeNet runs at every size; each FPN backbone (128x128 inputs) at one: ResNet-18's at 2 "
                    "ranks (2x1, 1x2), MobileNetV3's at 4 (2x2 and a hybrid)")
    build, loss_fn, side, side3 = MULTI_OUTPUT[name]
    torch.manual_seed(0)
    model = no_dropout(build().double())
    batches = _batches((2, 3, side3 if comm.size == 3 else side, side))
    check_update(comm, name, model, batches, loss_fn, layouts(comm.size, list(MULTI_OUTPUT).index(name)))


def test_swin_trains_as_one_process_through_fit_or_refuses_a_hybrid_grid_on_every_rank(comm):
    """Swin's window attention pads (whole samples), partitions windows with ``reshape(B * nW, ...)`` (a
    merged sample dim), crops with sizes read from the block and adds the residual to the block: on every
    spatial grid (one sample group) it trains exactly as one process through fit; on a sample x spatial
    hybrid, where the merged value cannot be matched to the block's cells, fit raises on every rank
    (it once trained 2.2e-3 off one process, silently)."""
    torch.manual_seed(0)
    model = no_dropout(swin().double())
    start = _flat(model)
    batches = _batches((2, 3, 96 if comm.size == 3 else 64, 64))
    expected = _reference_update(comm, model, batches, nn.CrossEntropyLoss())
    for grid, samples in suite_grids(comm.size):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # its pads redistribute (counted, named)
                trained = fit(copy.deepcopy(model), batches, nn.CrossEntropyLoss(), sgd, strategy="spatial",
                              grid=grid, samples=samples, progress=False).model
            gap, refused = float((_flat(trained) - start - expected).norm() / expected.norm()), ""
        except SpatialError as e:
            gap, refused = float("nan"), str(e)
        ok = gap < RTOL if samples == 1 else "merged their sample dim" in refused
        assert_all_ranks(comm, ok, f"grid {grid} x{samples}: relative update gap {gap:.3g}, refused: {refused!r}")
