"""Spatially parallel conv / pool / BN stacks equal the single-process torch layers: output, dL/dx, dL/dw."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpitrain.spatial import (
    Distribution,
    Redistribute,
    SpatialError,
    gather,
    parallelize,
    plan_grid,
    window_of,
)
from mpitrain.spatial.tensor import plain
from tests.helpers import assert_all_ranks, assert_close_all_ranks

pytestmark = pytest.mark.mpi
TOL = 1e-5


def layouts(size: int) -> list[tuple[tuple[int, int], int]]:
    """(grid, samples) for a world of `size`: every 1-D split, the 2-D one, and hybrid."""
    out = [((size, 1), 1), ((1, size), 1)]
    if size == 4:
        out += [((2, 2), 1), ((2, 1), 2)]
    return out


def sample_convs(seed: int, count: int) -> list[dict]:
    """A fixed-seed sample of the conv configuration space (kernel, stride, padding, dilation, groups,
    bias, uneven H and W, 1-2 samples)."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        k, s = rng.choice((1, 3, 5, 7)), rng.choice((1, 2))
        p, d = rng.choice((0, "same", 1)), rng.choice((1, 2))
        if p == "same" and s == 2:
            continue
        out.append(dict(k=k, s=s, p=p, d=d, groups=rng.choice((1, 2)), bias=rng.random() < 0.5,
                        h=rng.randint(9, 15), w=rng.randint(9, 15), n=rng.choice((1, 2))))
    return out


def feasible(model: nn.Module, shape, grid) -> bool:
    """Whether every window layer's input and output cover the grid (otherwise spatial refuses it)."""
    x = torch.zeros(shape)
    for m in model:
        if isinstance(m, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)):
            stride = getattr(m, "stride", None) or m.kernel_size
            try:
                plan_grid(tuple(x.shape[2:]), grid, window_of(m.kernel_size, stride, m.padding,
                                                              getattr(m, "dilation", 1)))
            except SpatialError:
                return False
        try:
            x = m(x)
        except RuntimeError:
            return False
    return True


def compare(comm, model: nn.Module, x: torch.Tensor, dist: Distribution, what: str,
            ref: nn.Module | None = None, rtol: float = TOL, **kw) -> None:
    """Run `model` (or its single-process twin `ref`) in one process and `model` spatially on `dist`;
    compare output, dL/dx and every dL/dw."""
    torch.manual_seed(1)
    ref = copy.deepcopy(model) if ref is None else ref
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    gy = torch.randn_like(yr)
    (yr * gy).sum().backward()
    pm = parallelize(model, dist, **kw)
    xl = dist.scatter(x.clone().requires_grad_())
    xl.retain_grad()
    y = pm(xl)
    assert_close_all_ranks(comm, gather(y), yr.detach(), TOL, rtol, f"{what}: output")
    (gather(y) * gy).sum().backward()  # the loss every rank computes on the full output
    assert_close_all_ranks(comm, gather(xl.grad, like=xl), xr.grad, TOL, rtol, f"{what}: dL/dx")
    for (name, p), pr in zip(model.named_parameters(), ref.parameters()):
        if pr.grad is None:  # a parameter the loss does not reach: no gradient, as in torch
            assert_all_ranks(comm, p.grad is None, f"{what}: dL/d{name} is set, torch leaves it None")
        else:
            assert_close_all_ranks(comm, p.grad, pr.grad, TOL, rtol, f"{what}: dL/d{name}")


@pytest.mark.parametrize("index", range(4))
def test_conv_bn_relu_stacks_equal_single_process_for_sampled_configurations(comm, index):
    grid, samples = layouts(comm.size)[index % len(layouts(comm.size))]
    dist = Distribution(comm, grid, samples)
    done = 0
    for c in sample_convs(seed=100 + index, count=24):
        if done == 4:
            break
        n = max(c["n"], samples)
        torch.manual_seed(0)
        conv = nn.Conv2d(4, 4, c["k"], c["s"], c["p"], c["d"], groups=c["groups"], bias=c["bias"])
        model = nn.Sequential(conv, nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 3, 3, 1, 1))
        shape = (n, 4, c["h"], c["w"])
        if not feasible(model, shape, grid):
            continue
        compare(comm, model, torch.randn(shape), dist, f"grid {grid} x{samples} {c}")
        done += 1
    assert_all_ranks(comm, done == 4, f"only {done} feasible configurations")


@pytest.mark.filterwarnings("ignore:Using padding='same'")  # torch's own, from the reference model
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_pools_and_bn_equal_single_process_with_padding_and_uneven_blocks(comm, overlap):
    for grid, samples in layouts(comm.size):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), nn.MaxPool2d(3, 2, 1), nn.BatchNorm2d(4),
                              nn.AvgPool2d(3, 1, 1, count_include_pad=False), nn.Conv2d(4, 4, 2, 1, "same"),
                              nn.AvgPool2d(2, 1, 1, count_include_pad=True),
                              nn.MaxPool2d(2, 1, 1, dilation=2),
                              nn.AvgPool2d(3, 2, 1, divisor_override=5))
        x = torch.randn(max(2, samples), 3, 15 if grid[0] > 1 else 11, 15 if grid[1] > 1 else 13)
        compare(comm, model, x, Distribution(comm, grid, samples), f"pools grid {grid}", overlap=overlap)


def test_maxpool_pads_with_minus_infinity_not_zero(comm):
    dist = Distribution(comm, (comm.size, 1), 1)
    model = nn.Sequential(nn.MaxPool2d(3, 1, 1))
    compare(comm, model, -1.0 - torch.rand(1, 2, 4 * comm.size + 1, 5), dist, "all-negative input")


def test_adaptive_avg_pool_feeds_a_replicated_linear_head(comm):
    for grid, samples in layouts(comm.size):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), nn.ReLU(), nn.AdaptiveAvgPool2d((2, 3)), nn.Flatten(),
                              nn.Linear(24, 5))
        x = torch.randn(2 * samples, 3, 13, 14)
        compare(comm, model, x, Distribution(comm, grid, samples), f"adaptive head grid {grid} x{samples}")


def test_local_batchnorm_normalises_each_block_by_its_own_statistics(comm):
    dist = Distribution(comm, (comm.size, 1), 1)
    bn = nn.BatchNorm2d(3)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 3 * comm.size + 2, 5)
    pm = parallelize(nn.Sequential(bn), dist, bn_stats="local")
    y = pm(dist.scatter(x))
    expected = nn.functional.batch_norm(plain(dist.scatter(x)), None, None, training=True)
    assert_close_all_ranks(comm, plain(y), expected, TOL, TOL, "local BN")


def test_local_batchnorm_gradients_equal_torch_on_each_block(comm):
    dist = Distribution(comm, (comm.size, 1), 1)
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    x = torch.randn(2, 3, 3 * comm.size + 2, 5)
    g = torch.randn_like(x)
    ref = copy.deepcopy(bn)
    block = plain(dist.scatter(x)).detach().clone().requires_grad_()
    (ref(block) * plain(dist.scatter(g))).sum().backward()
    xr = x.clone().requires_grad_()
    y = parallelize(nn.Sequential(bn), dist, bn_stats="local")(dist.scatter(xr))
    (gather(y) * g).sum().backward()
    assert_close_all_ranks(comm, plain(dist.scatter(xr.grad)), block.grad, TOL, TOL, "local BN dL/dx")
    for p, pr in ((bn.weight, ref.weight), (bn.bias, ref.bias)):  # the bucket sums every rank's share
        assert_close_all_ranks(comm, p.grad, comm.allreduce(pr.grad.clone(), "sum"), TOL, TOL, "local BN dL/dw")


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_local_batchnorm_running_statistics_equal_torch_on_each_block(comm, momentum):
    dist = Distribution(comm, (comm.size, 1), 1)
    bn = nn.BatchNorm2d(3, momentum=momentum)
    ref = copy.deepcopy(bn)
    pm = parallelize(nn.Sequential(bn), dist, bn_stats="local")
    for step in range(3):
        x = torch.randn(2, 3, 3 * comm.size + 2, 5, generator=torch.Generator().manual_seed(step))
        pm(dist.scatter(x))
        ref(plain(dist.scatter(x)))
    for name in ("running_mean", "running_var"):
        assert_close_all_ranks(comm, getattr(bn, name), getattr(ref, name), TOL, TOL, f"local BN {name}")
    assert_all_ranks(comm, int(bn.num_batches_tracked) == 3, f"{int(bn.num_batches_tracked)} batches counted")


def test_global_batchnorm_running_statistics_equal_single_process(comm):
    grid, samples = layouts(comm.size)[-1]
    dist = Distribution(comm, grid, samples)
    torch.manual_seed(0)
    bn, ref = nn.BatchNorm2d(3, momentum=None), nn.BatchNorm2d(3, momentum=None)
    pm = parallelize(nn.Sequential(bn), dist)
    for step in range(2):
        x = torch.randn(2 * samples, 3, 9, 10) + step
        pm(dist.scatter(x))
        ref(x)
    assert_close_all_ranks(comm, bn.running_mean, ref.running_mean, TOL, TOL, "running mean")
    assert_close_all_ranks(comm, bn.running_var, ref.running_var, TOL, TOL, "running var")
    pm.eval()
    ref.eval()
    x = torch.randn(samples, 3, 9, 10)
    assert_close_all_ranks(comm, gather(pm(dist.scatter(x))), ref(x), TOL, TOL, "eval output")


class BatchNormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d in short: a BatchNorm2d subclass whose own forward calls ``F.batch_norm``
    (counting the batch itself) and then its activation."""

    def forward(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
        return torch.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                       self.training, self.momentum, self.eps))


class AtenBatchNorm(nn.BatchNorm2d):
    """The same through ``torch.batch_norm`` (the ATen argument order), then a scale."""

    def forward(self, x):
        return 2 * torch.batch_norm(x, self.weight, self.bias, self.running_mean, self.running_var, self.training,
                                    self.momentum, self.eps, False)


class ConvSame(nn.Conv2d):
    """timm's Conv2dSame in short: a pad, then the conv with the layer's weight (padding 0)."""

    def forward(self, x):
        return F.conv2d(F.pad(x, (0, 1, 0, 1)), self.weight, self.bias, self.stride)


def test_subclasses_with_their_own_forward_keep_it_and_equal_single_process(comm):
    """A subclass of a swapped layer that replaces its forward is kept, not swapped (swapped, the
    activation after timm's batch norm was lost): its batch norm calls run spatially (global statistics,
    running statistics as torch's, nothing redistributed); a conv it computes itself redistributes,
    warned, and stays exact."""
    for grid, samples in layouts(comm.size):
        dist = Distribution(comm, grid, samples)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), BatchNormAct(4), AtenBatchNorm(4),
                              nn.Conv2d(4, 4, 3, 1, 1)).double()  # float64: two batch norms amplify rounding
        ref = copy.deepcopy(model)
        x = torch.randn(2 * samples, 3, 12, 10, dtype=torch.float64)
        compare(comm, model, x, dist, f"BatchNorm subclasses {grid} x{samples}", ref=ref)
        assert_all_ranks(comm, not dist.redistributions, f"redistributed {dist.redistributions}")
        for bn, bn_ref in zip(model[1:3], ref[1:3]):
            assert_close_all_ranks(comm, bn.running_var, bn_ref.running_var, TOL, TOL, f"{grid}: running var")
        model = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), ConvSame(4, 4, 2, 2))
        with pytest.warns(RuntimeWarning, match="not a spatial op"):
            compare(comm, model, torch.randn(samples, 3, 12, 10), Distribution(comm, grid, samples),
                    f"Conv2dSame-like {grid} x{samples}")


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.bn = nn.Conv2d(3, 3, 3, 1, 1), nn.Conv2d(3, 3, 5, 1, 2), nn.BatchNorm2d(3)

    def forward(self, x):
        return torch.relu(self.bn(self.a(x)) + self.b(x)) * 0.5


def test_fx_traceable_model_with_a_residual_add_equals_single_process(comm):
    dist = Distribution(comm, layouts(comm.size)[0][0], 1)
    torch.manual_seed(0)
    compare(comm, Residual(), torch.randn(2, 3, 11, 9), dist, "fx residual")


def test_halo_wider_than_the_neighbour_block_works(comm):
    dist = Distribution(comm, (comm.size, 1), 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 2, 7, 1, 3), nn.Conv2d(2, 2, 3, 1, 4, dilation=4))
    compare(comm, model, torch.randn(1, 2, 2 * comm.size + 1, 6), dist, "wide halo")


def test_output_smaller_than_the_grid_is_refused_on_every_rank_before_any_halo(comm):
    dist = Distribution(comm, (comm.size, 1), 1)
    pm = parallelize(nn.Sequential(nn.Conv2d(1, 1, 3, 2, 0)), dist)
    torch.manual_seed(0)
    x = dist.scatter(torch.randn(1, 1, comm.size + 2, 4))
    try:
        pm(x)
        msg = ""
    except SpatialError as e:
        msg = str(e)
    assert_all_ranks(comm, "cannot be split" in msg, f"expected a refusal, got {msg!r}")


def test_gradients_accumulate_over_two_backward_passes_like_torch(comm):
    dist = Distribution(comm, (comm.size, 1), 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, 1, 1), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 1, 3, 2, 1))
    ref = copy.deepcopy(model)
    pm = parallelize(model, dist)
    for x in (torch.randn(2, 2, 3 * comm.size, 7), torch.randn(2, 2, 3 * comm.size, 7) * 2):
        gather(pm(dist.scatter(x))).square().sum().backward()
        ref(x).square().sum().backward()
    for (name, p), pr in zip(model.named_parameters(), ref.parameters()):
        assert_close_all_ranks(comm, p.grad, pr.grad, 1e-4, TOL, f"accumulated dL/d{name}")


def test_redistribute_to_whole_samples_before_a_fully_connected_head(comm):
    spatial = Distribution(comm, layouts(comm.size)[0][0], 1)
    samples = Distribution(comm, (1, 1), comm.size)
    torch.manual_seed(0)
    body = [nn.Conv2d(2, 3, 3, 1, 1), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 2, 3, 2, 1)]
    head = [nn.Flatten(), nn.Linear(2 * 5 * 4, 3)]
    model = nn.Sequential(*body, Redistribute(spatial, samples), *head)
    ref = copy.deepcopy(nn.Sequential(*body, *head))
    compare(comm, model, torch.randn(comm.size + 1, 2, 9, 7), spatial, "conv -> redistribute -> linear", ref)


def test_channels_last_blocks_equal_single_process_and_stay_channels_last(comm):
    # oneDNN convolutions are several times faster channels-last on CPU: the layers must keep the format
    for grid, samples in layouts(comm.size):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.Conv2d(8, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.MaxPool2d(3, 1, 1),
                              nn.Conv2d(8, 4, 3, 1, 1)).to(memory_format=torch.channels_last)
        x = torch.randn(max(2, samples), 3, 17, 13).contiguous(memory_format=torch.channels_last)
        dist = Distribution(comm, grid, samples)
        # oneDNN's channels-last weight gradients sum ~100 terms of size ~10 in a blocked order: float32
        # rounding differs from the reference by ~1e-6 relative, over the 1e-5 absolute bound
        compare(comm, model, x, dist, f"channels-last grid {grid} x{samples}", rtol=1e-4)
        y = parallelize(copy.deepcopy(model), dist)(dist.scatter(x))
        assert_all_ranks(comm, y.is_contiguous(memory_format=torch.channels_last),
                         f"grid {grid}: output block has strides {y.stride()}, not channels-last")


def test_channels_last_weight_gradients_stay_channels_last(comm):
    # the fused gradient allreduce flattens each gradient in its memory order: no copy, same layout
    dist = Distribution(comm, (comm.size, 1), 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.BatchNorm2d(8)).to(memory_format=torch.channels_last)
    x = torch.randn(1, 3, 4 * comm.size + 1, 6).contiguous(memory_format=torch.channels_last)
    gather(parallelize(model, dist)(dist.scatter(x))).square().sum().backward()
    w = model[0].weight
    assert_all_ranks(comm, w.grad.stride() == w.stride(), f"grad strides {w.grad.stride()} vs {w.stride()}")


def test_tied_weights_get_the_sum_of_both_uses(comm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, 1, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, 1, 1))
    model[2].weight = model[0].weight  # one parameter, two layers
    compare(comm, model, torch.randn(2, 4, 13, 11), Distribution(comm, (comm.size, 1), 1), "tied conv weights")


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, 1, 1)
        self.spare = nn.Parameter(torch.ones(4))  # never used in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_an_unused_parameter_keeps_no_gradient_like_torch(comm):
    torch.manual_seed(0)
    model = _WithUnused()
    compare(comm, model, torch.randn(1, 3, 3 * comm.size + 1, 6), Distribution(comm, (comm.size, 1), 1),
            "unused parameter")  # checks spare.grad is None on every rank


def test_a_replaced_parameter_is_used_and_reduced(comm):
    dist = Distribution(comm, (comm.size, 1), 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), nn.Conv2d(4, 2, 3, 1, 1))
    pm = parallelize(model, dist)
    x = torch.randn(1, 3, 3 * comm.size + 2, 7)
    pm(dist.scatter(x))
    new = nn.Parameter(torch.randn_like(model[1].weight))
    pm.module[1].weight = new  # after a first forward: the next one must read and reduce the new one
    ref = copy.deepcopy(model)
    ref[1].weight = nn.Parameter(new.detach().clone())
    ref(x).square().sum().backward()
    gather(pm(dist.scatter(x))).square().sum().backward()
    assert_close_all_ranks(comm, new.grad, ref[1].weight.grad, TOL, TOL, "replaced weight")


def test_no_halo_send_stays_in_flight_after_forward_or_backward(comm):
    grid, samples = layouts(comm.size)[0]
    dist = Distribution(comm, grid, samples)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), nn.MaxPool2d(3, 1, 1), nn.Conv2d(4, 2, 5, 1, 2))
    pm = parallelize(model, dist)
    y = pm(dist.scatter(torch.randn(max(2, samples), 3, 16, 12)))
    assert_all_ranks(comm, not len(dist.sends), f"{len(dist.sends)} sends pending after forward")
    gather(y).square().sum().backward()
    assert_all_ranks(comm, not len(dist.sends), f"{len(dist.sends)} sends pending after backward")


def test_unsupported_layer_is_refused_on_every_rank_before_any_message(comm):
    grid, samples = layouts(comm.size)[0]
    dist = Distribution(comm, grid, samples)  # sends nothing
    model = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), nn.LPPool2d(2, 2))
    with pytest.raises(SpatialError, match="LPPool2d has no spatially parallel form"):
        parallelize(model, dist)
    assert_all_ranks(comm, dist._comms is None, "the communicators were split before the refusal")
    parallelize(model[:1], dist)  # an accepted model connects the distribution
    assert_all_ranks(comm, dist._comms is not None, "parallelize did not split the communicators")
