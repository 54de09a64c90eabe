"""timm (PyTorch Image Models) as a vision user brings them: ``timm.create_model(name, pretrained=False,
num_classes=5)`` with timm's defaults (drop rates 0; only the classes and, for the ViT, ``img_size``
shrunk), in float64, trained by ``fit(model, data, loss, optimizer, strategy=S)``. Parameters after 2 SGD
steps equal one process running the same micro-batches (BatchNorm statistics per data share or
micro-batch; over the whole batch under spatial, sample groups included), within 1e-9 relative to the
update, at 2, 3 and 4 ranks.

The suite's models, each chosen for what it exercises (docs/spatial.md lists the models checked outside it):
MobileNetV3-small (timm's ``BatchNormAct2d``, a BatchNorm subclass with its own forward; squeeze-excite,
hard-swish) under data, model and spatial (2x1, 1x2; 3x1; 2x2 and 2x1 x 2 samples), nothing redistributed;
ViT-tiny (the pipeline's fx capture of timm's fused attention and ``_assert``s) under data and model with
timm's ``SoftTargetCrossEntropy`` on ``Mixup``/CutMix soft targets (the pipeline as model at 2 and 3 ranks,
hybrid 2 x 2 at 4). ViT under ``strategy="auto"``: its spatial plans are dropped (a trial forward fails on
the blocks: timm's ``PatchEmbed`` asserts its input's size) and it trains as one process on the plan chosen;
``strategy="spatial"`` refuses it with a FitError on every rank."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from mpitrain.fit import FitError, fit
from mpitrain.planner import plan
from mpitrain.spatial.distribution import ranges
from mpitrain.spatial.models import suite_grids, torchvision_module
from tests.helpers import assert_all_ranks

torchvision_module("transforms")  # timm imports torchvision; its C++ ops are kept out (tests/README.md)
import timm  # noqa: E402
from timm.data import Mixup  # noqa: E402
from timm.loss import SoftTargetCrossEntropy  # noqa: E402

pytestmark = pytest.mark.mpi
STEPS, CLASSES, RTOL = 2, 5, 1e-9


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def build(name: str, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs).double()


def batches(rows: int, side: int, soft: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`STEPS` batches of `rows` images side x side with class targets, or with timm's Mixup/CutMix
    applied (mixed images, soft (rows, CLASSES) targets with label smoothing), the same on every rank."""
    g = torch.Generator().manual_seed(1)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=CLASSES) if soft else None
    out = []
    for step in range(STEPS):
        x = torch.randn(rows, 3, side, side, dtype=torch.float64, generator=g)
        y = torch.randint(0, CLASSES, (rows,), generator=g)
        if mixup is not None:
            import numpy as np  # Mixup draws its lambda and mode from numpy's global generator

            np.random.seed(step)
            x, y = mixup(x, y)
        out.append((x, y.double() if soft else y))
    return out


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def reference(model: nn.Module, data, loss_fn, slices: int) -> torch.Tensor:
    """One process's parameter update: each batch as `slices` equal pieces (a data share or micro-batch
    each: their BatchNorm statistics), the gradient of the mean loss."""
    model = copy.deepcopy(model)
    start, opt = _flat(model), sgd(model.parameters())
    for x, y in data:
        opt.zero_grad()
        for xs, ys in zip(x.chunk(slices), y.chunk(slices)):
            (loss_fn(model(xs), ys) / slices).backward()
        opt.step()
    return _flat(model) - start


def check(comm, what: str, model: nn.Module, data, loss_fn, slices: int, **options) -> None:
    """`fit` with `options` moves the parameters as one process does (relative gap under `RTOL`), with no
    activation redistributed (fit warns of each)."""
    expected = reference(model, data, loss_fn, slices)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        trained = fit(copy.deepcopy(model), data, loss_fn, sgd, progress=False, **options).model
    moves = sorted({str(w.message)[:120] for w in caught if "not a spatial op" in str(w.message)})
    gap = float((_flat(trained) - _flat(model) - expected).norm() / expected.norm())
    assert_all_ranks(comm, gap < RTOL and not moves,
                     f"{what} on {comm.size} ranks: relative update gap {gap:.3g}, redistributed {moves}")


def test_timm_mobilenetv3_trains_as_one_process_under_data_model_and_spatial(comm):
    """BatchNormAct2d (BatchNorm then its activation, one module): under spatial it was once swapped for
    the spatial BatchNorm and lost its activation (0.8-2 relative off one process, silently)."""
    size = comm.size
    model = build("mobilenetv3_small_100")
    side = 96 if size == 3 else 64  # the last feature map (1/32) gives every grid row a cell or more
    data = batches(2 * size, side)
    loss = nn.CrossEntropyLoss()
    check(comm, "data", model, data, loss, size, strategy="data")
    check(comm, "model", model, data, loss, size, strategy="model", partitions=size, micro_batches=size)
    for grid, samples in suite_grids(size)[:2]:  # 4 ranks: 2x2 and the hybrid 2x1 x 2 (1x2 x 2: torchvision's)
        # spatial BatchNorm statistics are global (every rank's cells, every sample group's): one slice
        check(comm, f"spatial {grid} x{samples}", model, batches(2 * samples, side), loss, 1,
              strategy="spatial", grid=grid, samples=samples)


def test_timm_vit_trains_as_one_process_on_mixup_soft_targets(comm):
    """SoftTargetCrossEntropy on Mixup/CutMix's (B, C) float targets: split with the rows under data, read
    by the last stage under model and hybrid."""
    size = comm.size
    model = build("vit_tiny_patch16_224", img_size=32)
    loss = SoftTargetCrossEntropy()
    data = batches(2 * size, 32, soft=True)
    check(comm, "data soft targets", model, data, loss, size, strategy="data")
    if size < 4:  # 4 ranks run the pipeline as hybrid 2 x 2
        check(comm, "model soft targets", model, data, loss, size, strategy="model", partitions=size,
              micro_batches=size)
    else:
        check(comm, "hybrid 2x2 soft targets", model, data, loss, 4, strategy="hybrid", partitions=2, replicas=2,
              micro_batches=2)


def test_timm_vit_auto_drops_the_spatial_plans_and_trains_as_one_process(comm, tmp_path_factory):
    """PatchEmbed asserts its input's height and width, so on any grid the forward fails on a block: every
    spatial layout is dropped with that reason (the same on every rank), and auto trains on what is left."""
    size = comm.size
    model = build("vit_tiny_patch16_224", img_size=32)
    loss = nn.CrossEntropyLoss()
    data = batches(2 * size, 32)
    cache = str(tmp_path_factory.mktemp("plans"))  # read and written by rank 0 only: fit reuses plan's calibration
    plans = plan(model, data[0], loss, comm=comm, strategies={"data", "spatial"}, cache=cache)
    spatial = [d for d in plans.dropped if d.strategy == "spatial"]
    why = "forward fails on the blocks of the batch's (3, 32, 32) samples (rank 0: AssertionError: Input"
    reasons = comm.allgather_object([d.describe() for d in spatial])
    assert_all_ranks(comm, [p.strategy for p in plans] == ["data"] and len(spatial) >= 2
                     and all(why in d.reason for d in spatial) and all(r == reasons[0] for r in reasons),
                     f"{plans.table()}\n{plans.explanation()}")
    check(comm, "auto", model, data, loss, size, strategy="auto", strategies=("data", "spatial"), cache=cache)


def test_timm_vit_under_spatial_is_refused_naming_the_block_and_the_alternatives(comm):
    model = build("vit_tiny_patch16_224", img_size=32)
    try:
        fit(model, batches(2, 32)[:1], nn.CrossEntropyLoss(), sgd, progress=False, strategy="spatial",
            grid=(1, comm.size))
        message = "no error"
    except FitError as e:
        message = str(e)
    a, b = ranges(32, comm.size)[comm.rank]  # this rank's columns
    want = (f"the model's forward failed on rank {comm.rank}'s spatial block (3, 32, {b - a}) of the batch's "
            f"(3, 32, 32) samples (grid (1, {comm.size})): AssertionError: Input width")
    assert_all_ranks(comm, want in message and "'data', 'model' or 'hybrid'" in message, message)
