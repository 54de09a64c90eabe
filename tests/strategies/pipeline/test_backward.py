"""The backward split into its input half and its weight half (the zero-bubble schedules' I and W),
against one whole backward in one process: the same gradients, and the same kernels run once."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpitrain.strategies.pipeline._backward import input_gradients


class Count(TorchDispatchMode):
    """Counts the ATen ops run (the backward's kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class Chain(nn.Module):
    """Linear layers, a LayerNorm, a weight used twice on the input path (a tie inside one partition),
    a weight multiplied directly (no transpose node between it and the matmul), and a second output
    computed from parameters alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(6, 8), nn.Linear(8, 8), nn.LayerNorm(8)
        self.w = nn.Parameter(torch.randn(8, 8))
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tanh(self.a(x)) + h
        y = self.norm(self.b(torch.relu(self.b(y))))
        y = torch.mm(torch.tanh(torch.mm(y, self.w)), self.w)
        first, second = y.split(4, dim=1)  # a node with two outputs
        return first * second, self.bias * 2.0


def run(model, x, h, grads, split: bool, leaves: bool = True):
    model = copy.deepcopy(model)
    x, h = x.clone().requires_grad_(leaves), h.clone().requires_grad_(leaves)
    outs = list(model(x, h))
    params = list(model.parameters())
    count = Count()
    with count:
        if split:
            work = input_gradients(outs, grads, [x, h] if leaves else [], params)
            after_input = {k: (None if q.grad is None else q.grad.clone()) for k, q in model.named_parameters()}
            work.run()
        else:
            torch.autograd.backward(outs, grads)
            after_input = {}
    return model, x.grad, h.grad, count.ops, after_input


@pytest.mark.parametrize("leaves", [True, False])
def test_input_then_weight_half_equal_one_backward_and_run_each_kernel_once(leaves):
    """Gradients equal one backward's; the matrix products and the LayerNorm backward run once (the
    tie recomputes its input path once); 1-D parameters' gradients are final after the input half."""
    torch.manual_seed(0)
    model = Chain().double()
    x, h = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    grads = [torch.randn(5, 4, dtype=torch.float64), torch.randn(8, dtype=torch.float64)]
    want, wx, wh, ops, _ = run(model, x, h, grads, split=False, leaves=leaves)
    got, gx, gh, split_ops, after_input = run(model, x, h, grads, split=True, leaves=leaves)
    if leaves:
        assert torch.allclose(gx, wx, atol=1e-14) and torch.allclose(gh, wh, atol=1e-14)
        # the input half computes the 1-D parameters' gradients (biases, the norm's scale and shift),
        # final at once; the matrices' wait for the weight half
        for name, q in got.named_parameters():
            assert (after_input[name] is not None) == (q.dim() <= 1), name
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-14), name
        if leaves and p.dim() <= 1:
            assert torch.equal(after_input[name], p.grad), f"the weight half changed {name}'s gradient"
    # the LayerNorm's backward runs once, as in one backward (its scale's gradient is the input half's)
    assert split_ops["native_layer_norm_backward"] == ops["native_layer_norm_backward"] == 1
    # the same matrix products as one backward (the weight used twice recomputes its input path once)
    products = {k: v for k, v in ops.items() if k in ("mm", "addmm", "bmm")}
    split_products = {k: v for k, v in split_ops.items() if k in ("mm", "addmm", "bmm")}
    extra = sum(split_products.values()) - sum(products.values())
    assert 0 <= extra <= (2 if leaves else 0), (products, split_products)


def test_a_linear_chain_runs_exactly_the_kernels_of_one_backward():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    grads = [torch.randn(4, 3, dtype=torch.float64)]

    def once(split: bool):
        m = copy.deepcopy(model)
        leaf = x.clone().requires_grad_()
        out = m(leaf)
        count = Count()
        with count:
            if split:
                input_gradients([out], grads, [leaf], list(m.parameters())).run()
            else:
                torch.autograd.backward([out], grads)
        return m, leaf.grad, count.ops

    want, wx, ops = once(False)
    got, gx, split_ops = once(True)
    assert torch.equal(gx, wx)
    for p, q in zip(got.parameters(), want.parameters()):
        assert torch.equal(p.grad, q.grad)
    heavy = ("mm", "addmm", "t", "gelu_backward", "tanh_backward", "sum")
    assert {k: split_ops[k] for k in heavy} == {k: ops[k] for k in heavy}, (split_ops, ops)


def test_a_scalar_loss_seeds_with_one_and_unused_parameters_keep_no_gradient():
    torch.manual_seed(2)
    lin, unused = nn.Linear(3, 2).double(), nn.Parameter(torch.ones(2, dtype=torch.float64))
    leaf = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    loss = lin(leaf).square().mean()
    input_gradients([loss], [None], [leaf], [*lin.parameters(), unused]).run()
    ref = copy.deepcopy(lin)
    ref_leaf = leaf.detach().clone().requires_grad_()
    ref(ref_leaf).square().mean().backward()
    assert torch.equal(leaf.grad, ref_leaf.grad) and unused.grad is None
    assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(lin.bias.grad, ref.bias.grad)
