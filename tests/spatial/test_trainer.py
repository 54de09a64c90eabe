"""`fit(strategy="spatial")`: hybrid sample x spatial training steps equal one process; bad options are
refused on every rank before any message."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpitrain.fit import FitError, fit
from mpitrain.spatial import Distribution, SpatialError
from mpitrain.spatial.mesh import mesh_batch, mesh_model
from mpitrain.spatial.trainer import make_trainer
from tests.helpers import assert_all_ranks, assert_close_all_ranks

pytestmark = pytest.mark.mpi


def hybrid_layouts(size: int) -> list[tuple[tuple[int, int], int]]:
    """One pure-spatial and one sample x spatial (or pure sample) layout for `size` ranks."""
    if size % 2 == 0:
        return [((size // 2, 2) if size == 4 else (size, 1), 1), ((size // 2, 1), 2)]
    return [((size, 1), 1), ((1, 1), size)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.mark.parametrize("which", [0, 1], ids=["spatial", "hybrid"])
def test_fit_spatial_steps_equal_one_process(comm, which):
    grid, samples = hybrid_layouts(comm.size)[which]
    torch.manual_seed(0)
    model = mesh_model(in_channels=3, widths=(4, 6, 8), convs_per_block=2)
    ref = copy.deepcopy(model)
    data = [mesh_batch(2 * samples, 28, in_channels=3, blocks=3, seed=s) for s in range(3)]
    loss_fn = nn.CrossEntropyLoss()
    result = fit(model, data, loss_fn, sgd, strategy="spatial", grid=grid, samples=samples, progress=False,
                 eval_data=data[:1])
    opt, losses = sgd(ref.parameters()), []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for (name, a), b in zip(result.model.state_dict().items(), ref.state_dict().values()):
        assert_close_all_ranks(comm, a.double(), b.double(), 1e-5, 1e-5, f"{name} after 3 steps, grid {grid}")
    assert_all_ranks(comm, abs(result.history[0]["loss"] - sum(losses) / 3) < 1e-5, f"loss {result.history}")
    ref.eval()
    with torch.no_grad():
        eval_loss = loss_fn(ref(data[0][0]), data[0][1]).item()
    assert_all_ranks(comm, abs(result.history[0]["eval_loss"] - eval_loss) < 1e-5, "eval loss")


@pytest.mark.parametrize("options", [{"grid": (3, 5)}, {"grid": (1, 1), "samples": 1}, {"bn_stats": "bogus"},
                                     {"grid": (1, 1), "colour": 1}, {"grid": (2, 0)}, {"overlap": "yes"},
                                     {"nonspatial": "gather"}], ids=str)
def test_bad_spatial_options_are_refused_on_every_rank_before_any_message(comm, options):
    from mpitrain.fit import FitSpec

    opts = dict(options)
    if opts.get("grid") == (1, 1) and "samples" in opts:
        opts["samples"] = comm.size + 1
    try:
        make_trainer(nn.Conv2d(1, 1, 1), nn.MSELoss(), sgd, comm, FitSpec(strategy="spatial", options=opts))
        msg = ""
    except FitError as e:
        msg = str(e)
    assert_all_ranks(comm, bool(msg), f"{opts} was accepted")


def test_a_volume_model_or_batch_on_a_2d_grid_is_refused_naming_the_3d_grid_to_pass(comm):
    """A model with 3-D layers given a 2-D grid: FitError at make_trainer (before any message), naming the
    grid it got and the one to pass; a 5-D batch for a model without 3-D layer modules: FitError at the
    step, on every rank, before that step's messages."""
    from mpitrain.fit import FitSpec

    volume = nn.Sequential(nn.Conv3d(1, 2, 3, 1, 1), nn.AdaptiveAvgPool3d(1), nn.Flatten())
    try:
        make_trainer(volume, nn.MSELoss(), sgd, comm, FitSpec(strategy="spatial", options={"grid": (comm.size, 1)}))
        msg = ""
    except FitError as e:
        msg = str(e)
    wanted = f"grid=({comm.size}, 1) is 2-D; pass grid=(1, {comm.size}, 1)"
    assert_all_ranks(comm, "(N, C, D, H, W)" in msg and wanted in msg, msg)
    flat = nn.Sequential(nn.Flatten(), nn.Linear(4 * comm.size * 4 * 4, 2))  # no 3-D layer to tell
    data = [(torch.randn(2, 1, 4, 4 * comm.size, 4), torch.randn(2, 2))]
    try:
        fit(flat, data, nn.MSELoss(), sgd, strategy="spatial", grid=(comm.size, 1), progress=False)
        msg = ""
    except FitError as e:
        msg = str(e)
    assert_all_ranks(comm, "batch of shape (2, 1, 4" in msg and wanted in msg, msg)


def test_distribution_with_the_wrong_number_of_ranks_is_refused_on_every_rank(comm):
    try:
        Distribution(comm, (comm.size, 2), 1)
        msg = ""
    except SpatialError as e:
        msg = str(e)
    assert_all_ranks(comm, "ranks" in msg, msg)


def test_fit_stall_policy_bounds_the_halo_waits(comm):
    from mpitrain._utils.stall import StallPolicy
    from mpitrain.fit import FitSpec

    spec = FitSpec(strategy="spatial", options={"grid": (comm.size, 1)}, stall=StallPolicy(7.0, None))
    trainer = make_trainer(nn.Conv2d(1, 1, 3, 1, 1), nn.MSELoss(), sgd, comm, spec)
    assert_all_ranks(comm, trainer.dist.sends.warn_after == 7.0, f"warn_after {trainer.dist.sends.warn_after}")
