"""DistributedOptimizer, broadcast_parameters and broadcast_optimizer_state over real MPI at 2, 3 and 4
ranks, against the same training in one process; cases adapted from Horovod's test_torch.py."""

from __future__ import annotations

import inspect
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mpitrain.horovod as hvd
from tests.helpers import assert_all_ranks

from ._util import close, raises_everywhere

pytestmark = pytest.mark.mpi


@pytest.fixture(autouse=True)
def _init():
    hvd.init()


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _optimizers():
    """Every torch.optim optimizer, as Horovod's tests iterate over them: L-BFGS and SparseAdam excluded as
    there, and Muon (newer than Horovod) as it takes 2-D parameters only."""
    excluded = {"LBFGS", "SparseAdam", "Muon"}
    found = [c for c in torch.optim.Optimizer.__subclasses__()
             if c.__module__.startswith("torch.optim") and c.__name__ not in excluded]
    return sorted(found, key=lambda c: c.__name__)


def _rank_grads(model, inputs, loss_fn):
    """Gradients of `model` (a copy that no DistributedOptimizer hooks) for each rank's input, flat."""
    out = []
    for inp in inputs:
        model.zero_grad()
        loss_fn(model, inp).backward()
        out.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in model.parameters()]))
    return out


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _new_optimizer(cls, params, options):
    accepted = inspect.signature(cls.__init__).parameters
    return cls(params, **{k: v for k, v in options.items() if k in accepted})


# -- training equals one process -------------------------------------------------------------------------
@pytest.mark.parametrize("passes, predivide", [(1, 1.0), (2, 1.0), (1, 2.0)])
def test_training_matches_one_process_on_the_global_batch(comm, passes, predivide):
    """k steps of DistributedOptimizer (several buckets; backward_passes_per_step; predivide) leave the
    parameters of a one-process run on the concatenated batch (float64)."""
    per_rank, steps = 4 * passes, 3
    x, y = _data(per_rank * comm.size * steps)
    ref = _mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model = _mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                   gradient_predivide_factor=predivide, bucket_mb=0.001, first_bucket_mb=0.0005)
    assert_all_ranks(comm, len(opt.buckets) > 2, f"{len(opt.buckets)} buckets")
    for s in range(steps):
        xs = x[s * per_rank * comm.size:(s + 1) * per_rank * comm.size]
        ys = y[s * per_rank * comm.size:(s + 1) * per_rank * comm.size]
        ref_opt.zero_grad()
        F.mse_loss(ref(xs), ys).backward()
        ref_opt.step()
        mine_x, mine_y = xs.chunk(comm.size)[comm.rank], ys.chunk(comm.size)[comm.rank]
        opt.zero_grad()
        for xm, ym in zip(mine_x.chunk(passes), mine_y.chunk(passes)):
            (F.mse_loss(model(xm), ym) / passes).backward()
        opt.step()
    close(comm, _flat(model), _flat(ref), f"passes={passes} predivide={predivide}", 1e-12)


def test_sum_op_and_overlap_with_backward(comm):
    """op=Sum leaves the sum of the ranks' gradients; buckets leave during backward (handles exist when
    backward returns, before step)."""
    model = _mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum,
                                   named_parameters=model.named_parameters(), bucket_mb=0.001, first_bucket_mb=0.0005)
    x, y = _data(4 * comm.size)
    xs, ys = x.chunk(comm.size), y.chunk(comm.size)
    grads = _rank_grads(_mlp(), range(comm.size), lambda m, r: F.mse_loss(m(xs[r]), ys[r]))
    opt.zero_grad()
    F.mse_loss(model(xs[comm.rank]), ys[comm.rank]).backward()
    sent_during_backward = len(opt._handles)
    opt.synchronize()
    assert_all_ranks(comm, sent_during_backward == len(opt.buckets) > 2, f"{sent_during_backward} sent")
    close(comm, _grads(model), sum(grads), "sum", 1e-12)
    with opt.skip_synchronize():
        opt.step()


class _Branches(nn.Module):
    """Rank-dependent branches, run in rank-dependent order: gradients become ready in a different
    order on each rank and some parameters get none on some ranks (or on every rank: `spare`)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4).double(), nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
        self.spare = nn.Linear(4, 4).double()

    def forward(self, x, rank):
        branches = [self.a, self.b, self.c][: 1 + rank % 3]
        order = branches if rank % 2 == 0 else branches[::-1]
        return sum(m(x) for m in order)


def test_unused_parameters_are_reduced_as_zeros_whatever_the_readiness_order(comm):
    model, ref = _Branches(), _Branches()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), bucket_mb=1e-4, first_bucket_mb=1e-4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for step in range(2):
        expected = sum(_rank_grads(ref, range(comm.size), lambda m, r: m(x, r).pow(2).sum())) / comm.size
        opt.zero_grad()
        model(x, comm.rank).pow(2).sum().backward()
        opt.synchronize()
        close(comm, _grads(model), expected, f"step {step}", 1e-12)
        with opt.skip_synchronize():
            opt.step()
        with torch.no_grad():  # the reference takes the same step
            for p, g in zip(ref.parameters(), expected.split([p.numel() for p in ref.parameters()])):
                p.grad = g.view_as(p).clone()
        ref_opt.step()
        close(comm, _flat(model), _flat(ref), f"params after step {step}", 1e-12)


def test_returns_the_wrapped_class_and_refuses_bad_arguments(comm):
    model = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    assert_all_ranks(comm, isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD")
    named = list(model.named_parameters())
    raises_everywhere(comm, ValueError, lambda: hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2))
    raises_everywhere(comm, ValueError, lambda: hvd.DistributedOptimizer(sgd, named_parameters=named[:1]),
                      match="not named")
    raises_everywhere(comm, ValueError, lambda: hvd.DistributedOptimizer(
        sgd, named_parameters=[("same", p) for _, p in named]), match="duplicates")
    raises_everywhere(comm, ValueError, lambda: hvd.DistributedOptimizer(sgd, named_parameters=[p for _, p in named]))
    raises_everywhere(comm, ValueError, lambda: hvd.DistributedOptimizer(sgd, backward_passes_per_step=0))
    raises_everywhere(comm, NotImplementedError, lambda: hvd.DistributedOptimizer(sgd, op=hvd.Adasum))
    other = _mlp() if comm.rank == 0 else nn.Linear(6, 3).double()
    raises_everywhere(comm, hvd.HorovodInternalError,
                      lambda: hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1)))


def test_synchronize_step_warning_clipping_and_zero_grad_race(comm):
    x, y = torch.ones(1, 1), torch.ones(1, 1)
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(0.5), model.bias.zero_()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    raised = False
    try:
        opt.zero_grad()
    except AssertionError:
        raised = True
    opt.synchronize()
    prior = model.weight.grad.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    clipped = model.weight.grad.item()
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        opt.step()
    ok = raised and abs(prior) > abs(clipped) and not quiet and len(ws) == 1
    ok = ok and "optimizer.step() called without optimizer.skip_synchronize()" in str(ws[0].message)
    assert_all_ranks(comm, ok, f"raised={raised} {prior} {clipped} {[str(w.message) for w in ws]}")


def test_dynamic_requires_grad_and_no_named_parameters(comm):
    gen, disc = nn.Conv2d(1, 10, 1), nn.Conv2d(10, 1, 1)
    inp = torch.rand([1, 1, 10, 10])
    gen_opt = hvd.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1))
    disc_opt = hvd.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                        named_parameters=disc.named_parameters())
    ok = True
    for train_gen in [True, False] * 3:
        for p in gen.parameters():
            p.requires_grad_(train_gen)
        for p in disc.parameters():
            p.requires_grad_(not train_gen)
        gen_opt.zero_grad()
        disc_opt.zero_grad()
        disc(gen(inp)).sum().backward()
        ok &= all(train_gen == (p.grad is not None and bool(p.grad.abs().max() > 0)) for p in gen.parameters())
        ok &= all((not train_gen) == (p.grad is not None and bool(p.grad.abs().max() > 0)) for p in disc.parameters())
        (gen_opt if train_gen else disc_opt).step()
    assert_all_ranks(comm, ok)


def test_unnamed_parameters_in_several_groups_get_unique_names_equal_on_every_rank(comm):
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([{"params": model[0].parameters()},
                                                    {"params": model[1].parameters()}], lr=0.001))
    names = opt._parameter_names
    everywhere = hvd.allgather_object(set(names.values()))
    assert_all_ranks(comm, len(names) == len(set(names.values())) == 4 and all(n == everywhere[0]
                                                                             for n in everywhere))


def test_force_allreduce_with_every_optimizer(comm):
    """Rank 0's loss ignores fc3, the others' use it: every optimizer still steps the same everywhere."""
    x, y = torch.randn(16, 10, generator=torch.Generator().manual_seed(0)), torch.randn(16, 10)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(10, 8), nn.Linear(8, 10), nn.Linear(10, 10)

        def forward(self, x_):
            x1 = self.fc2(F.relu(self.fc1(x_)))
            return x1, self.fc3(F.relu(x1))

    for cls, options in itertools.product(_optimizers(), [dict(lr=0.2, momentum=0.9, weight_decay=0.1,
                                                               centered=True), dict(lr=0.2)]):
        torch.manual_seed(0)
        model = Net()
        opt = hvd.DistributedOptimizer(_new_optimizer(cls, model.parameters(), options),
                                       named_parameters=model.named_parameters())
        y1, y2 = model(x)
        loss = F.mse_loss(y1 if comm.rank == 0 else y2, y, reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()
        gathered = hvd.allgather_object(_flat(model))
        assert_all_ranks(comm, all(torch.equal(g, gathered[0]) for g in gathered), f"{cls.__name__} {options}")


def test_optimizer_on_a_process_set(comm):
    evens = hvd.add_process_set([r for r in range(comm.size) if r % 2 == 0])
    odds = hvd.add_process_set([r for r in range(comm.size) if r % 2 == 1])
    mine = evens if comm.rank % 2 == 0 else odds
    try:
        model = _mlp()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_set=mine,
                                       named_parameters=model.named_parameters())
        x, y = _data(2 * comm.size)
        xs, ys = x.chunk(comm.size), y.chunk(comm.size)
        grads = _rank_grads(_mlp(), mine.ranks, lambda m, r: F.mse_loss(m(xs[r]), ys[r]))
        opt.zero_grad()
        F.mse_loss(model(xs[comm.rank]), ys[comm.rank]).backward()
        opt.synchronize()
        close(comm, _grads(model), sum(grads) / len(grads), "set average", 1e-12)
    finally:
        hvd.remove_process_set(evens)
        hvd.remove_process_set(odds)


def test_join_with_uneven_steps(comm):
    """Rank 0 runs out of data one step early and joins; the others' last step averages over size()."""
    model = _mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters())
    x, y = _data(2 * comm.size)
    xs, ys = x.chunk(comm.size), y.chunk(comm.size)
    last = None
    for _ in range(1 if comm.rank == 0 else 2):
        opt.zero_grad()
        F.mse_loss(model(xs[comm.rank]), ys[comm.rank]).backward()
        opt.step()
        last = _grads(model)
    ret = hvd.join()
    grads = _rank_grads(_mlp(), range(comm.size), lambda m, r: F.mse_loss(m(xs[r]), ys[r]))
    expected = sum(grads) / comm.size if comm.rank == 0 else sum(grads[1:]) / comm.size
    close(comm, last, expected, "joined rank counts as zeros", 1e-12)
    assert_all_ranks(comm, ret != 0 and hvd.allgather_object(ret) == [ret] * comm.size)


# -- broadcasts of parameters and optimizer state --------------------------------------------------------
def _state_values(optimizer):
    sd = optimizer.state_dict()
    out = []
    for group in sd["param_groups"]:
        out += [(k, v) for k, v in sorted(group.items()) if k != "params"]
        for pid in group["params"]:
            out += sorted(sd["state"].get(pid, {}).items())
    return out


def test_broadcast_state_reaches_fresh_optimizers_without_a_dummy_step(comm):
    for cls, options in itertools.product(_optimizers(), [dict(lr=0.2, momentum=0.9, weight_decay=0.1,
                                                               centered=True), dict(lr=0.2)]):
        model = _mlp(seed=comm.rank)  # different weights on every rank
        base = _new_optimizer(cls, model.parameters(), options)
        if comm.rank == 0:  # only the root has state (as after loading a checkpoint); the others are fresh
            F.mse_loss(model(torch.ones(2, 6, dtype=torch.float64)), torch.zeros(2, 3, dtype=torch.float64)).backward()
            base.step()
            base.zero_grad()
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        mine = (_flat(model), _state_values(opt))
        root = hvd.broadcast_object(mine, root_rank=0)
        ok = torch.equal(mine[0], root[0]) and len(mine[1]) == len(root[1])
        ok = ok and all(k1 == k2 and (torch.equal(v1, v2) if torch.is_tensor(v1) else v1 == v2)
                        for (k1, v1), (k2, v2) in zip(mine[1], root[1]))
        assert_all_ranks(comm, ok, f"{cls.__name__} {options}")


def test_broadcast_state_options_and_params_without_grad(comm):
    model = _mlp(seed=comm.rank)
    model[0].weight.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (comm.rank + 1), momentum=0.1 * comm.rank,
                          weight_decay=0.01 * comm.rank)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=comm.size - 1)
    hvd.broadcast_optimizer_state(opt, root_rank=comm.size - 1)
    g = opt.param_groups[0]
    expected = (0.1 * comm.size, 0.1 * (comm.size - 1), 0.01 * (comm.size - 1))
    same_params = hvd.allgather_object(_flat(model))
    ok = (g["lr"], g["momentum"], g["weight_decay"]) == expected and all(torch.equal(p, same_params[0])
                                                                          for p in same_params)
    assert_all_ranks(comm, ok, f"{(g['lr'], g['momentum'], g['weight_decay'])} vs {expected}")
    raises_everywhere(comm, ValueError, lambda: hvd.broadcast_optimizer_state(
        torch.optim.LBFGS(model.parameters()), root_rank=0))
    raises_everywhere(comm, ValueError, lambda: hvd.broadcast_parameters(torch.ones(2), root_rank=0))


def test_fp16_compression(comm):
    for dtype, dim in itertools.product([torch.uint8, torch.int32, torch.float32, torch.float64], [1, 2, 3]):
        tensor = (torch.ones([17] * dim) * 3).to(dtype)
        summed = hvd.allreduce(tensor, op=hvd.Sum, compression=hvd.Compression.fp16)
        assert_all_ranks(comm, summed.dtype == dtype and bool((summed == (tensor * comm.size).to(dtype)).all()))
    model, ref = _mlp(), _mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=hvd.Compression.fp16)
    x, y = _data(4 * comm.size)
    F.mse_loss(ref(x), y).backward()
    opt.zero_grad()
    F.mse_loss(model(x.chunk(comm.size)[comm.rank]), y.chunk(comm.size)[comm.rank]).backward()
    opt.synchronize()
    got = _grads(model)
    close(comm, got, _grads(ref), "fp16 grads", 2e-3)
    assert_all_ranks(comm, got.dtype == torch.float64)


def test_broadcast_parameters_with_a_long_signature(comm):
    """A state dict whose negotiated signature exceeds the fixed negotiation slot (names of 200 tensors)
    still negotiates (the pickled fallback) and broadcasts, uint8 and int16 tensors included."""
    params = {f"layer{i:03d}.a_rather_long_parameter_name": torch.full((3,), float(comm.rank + i)) for i in range(200)}
    params["bytes"] = torch.full((4,), comm.rank + 7, dtype=torch.uint8)
    params["shorts"] = torch.full((2,), -comm.rank - 300, dtype=torch.int16)
    hvd.broadcast_parameters(params, root_rank=comm.size - 1)
    root = comm.size - 1
    ok = all(torch.equal(params[f"layer{i:03d}.a_rather_long_parameter_name"], torch.full((3,), float(root + i)))
             for i in range(200))
    ok = ok and params["bytes"].tolist() == [root + 7] * 4 and params["shorts"].tolist() == [-root - 300] * 2
    assert_all_ranks(comm, ok)
