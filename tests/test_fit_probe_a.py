"""Activation checkpointing (a Hugging Face model's ``gradient_checkpointing_enable``, or
``torch.utils.checkpoint`` in a plain module's forward) under the pipeline.

transformers' default (``use_reentrant=False``) trains under "model" exactly as one process does (float64,
parameters after 2 steps). ``use_reentrant=True`` runs each layer under ``no_grad`` inside an
autograd.Function that torch.export does not keep: the captured graph would train nothing inside those
layers (the last partition's loss had no grad_fn: one rank raised, the others waited in the tied-weight
allreduce until the job's stall limit). It is refused with FitError on every rank before any message; a
``no_grad`` block the forward means (a frozen part) is not refused and trains as one process does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpitrain.fit import FitError, fit
from tests.helpers import assert_close_all_ranks
from tests.strategies.pipeline.tiny_transformers import build, lm_batches, lm_loss

pytestmark = pytest.mark.mpi

B = 4


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def one_process(model: nn.Module, batches, loss_fn=lm_loss) -> nn.Module:
    """The same training in one process: the loss of the whole batch, one SGD step per batch."""
    model = copy.deepcopy(model)
    model.train()
    opt = sgd(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(**x) if isinstance(x, dict) else model(x), y).backward()
        opt.step()
    return model


def checkpointed(**kwargs) -> nn.Module:
    model = build("gpt2")
    model.gradient_checkpointing_enable(**kwargs)
    return model


@pytest.mark.filterwarnings("ignore")
def test_default_gradient_checkpointing_trains_as_one_process_under_model(comm):
    batches = lm_batches(B, 2, seed=5, mask=False)
    want = one_process(checkpointed(), batches)
    result = fit(checkpointed(), batches, lm_loss, sgd, strategy="model", partitions=comm.size, micro_batches=2,
                 progress=False)
    got = dict(result.model.named_parameters())
    for name, p in want.named_parameters():
        assert_close_all_ranks(comm, got[name].detach(), p.detach(), atol=1e-12, what=name)


@pytest.mark.filterwarnings("ignore")
def test_reentrant_gradient_checkpointing_is_refused_under_model_on_every_rank(comm):
    batches = lm_batches(B, 2, seed=5, mask=False)
    model = checkpointed(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(FitError, match="use_reentrant=False"):
        fit(model, batches, lm_loss, sgd, strategy="model", partitions=comm.size, micro_batches=2, progress=False,
            abort_after=60)


class Checkpointed(nn.Module):
    """A plain module whose forward checkpoints its middle layer itself, or runs it under no_grad (a frozen
    block: nothing before it trains either) or in bfloat16 autocast (float32 weights)."""

    def __init__(self, reentrant: bool | str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.reentrant = reentrant  # "no_grad" / "autocast": that block instead of checkpointing
        self.to(torch.float32 if reentrant == "autocast" else torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x.to(self.a.weight.dtype)))
        if self.reentrant == "no_grad":
            with torch.no_grad():
                h = h + torch.tanh(self.b(h))
        elif self.reentrant == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = torch.tanh(self.b(h)).float()
        else:
            h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)
        return self.c(h)


def plain_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(B, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g))
            for _ in range(2)]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("reentrant", [False, "no_grad", "autocast"])
def test_checkpoint_no_grad_and_autocast_blocks_of_a_plain_module_train_as_one_process_under_model(comm, reentrant):
    """fx runs a no_grad / autocast block while tracing without recording it: such a forward is captured by
    torch.export, which keeps both (fx's graph trained the frozen layers, and the block in float64)."""
    batches = plain_batches()
    want = one_process(Checkpointed(reentrant), batches, nn.functional.cross_entropy)
    result = fit(Checkpointed(reentrant), batches, nn.functional.cross_entropy, sgd, strategy="model",
                 partitions=comm.size, micro_batches=1 if reentrant == "autocast" else 2, progress=False,
                 abort_after=60)  # autocast: one micro-batch, so bfloat16 rounds the very sums one process does
    got = dict(result.model.named_parameters())
    for name, p in want.named_parameters():
        assert_close_all_ranks(comm, got[name].detach(), p.detach(), atol=1e-12, what=name)


@pytest.mark.filterwarnings("ignore")
def test_reentrant_torch_checkpoint_of_a_plain_module_is_refused_under_model_on_every_rank(comm):
    with pytest.raises(FitError, match="use_reentrant=False"):
        fit(Checkpointed(True), plain_batches(), nn.functional.cross_entropy, sgd, strategy="model",
            partitions=comm.size, micro_batches=2, progress=False, abort_after=60)


class _Reverse(torch.autograd.Function):
    """A gradient reversal layer (domain adaptation): identity forward, negated backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class Reversed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_Reverse.apply(torch.tanh(self.a(x))))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("strategy", ["model", "data"])
def test_a_custom_autograd_function_is_refused_under_model_and_trains_as_one_process_under_data(comm, strategy):
    """A captured graph records a custom Function's forward ops, not its backward: the partitions trained
    ``a`` with the reversed gradient's opposite. Refused on every rank; data runs the forward as it is."""
    if strategy == "model":
        with pytest.raises(FitError, match="custom autograd.Function .*_Reverse"):
            fit(Reversed(), plain_batches(), nn.functional.cross_entropy, sgd, strategy="model", partitions=comm.size,
                progress=False, abort_after=60)
        return
    want = one_process(Reversed(), plain_batches(), nn.functional.cross_entropy)
    got = fit(Reversed(), plain_batches(), nn.functional.cross_entropy, sgd, strategy="data", progress=False,
              abort_after=60).model
    for (name, p), q in zip(want.named_parameters(), got.parameters()):
        assert_close_all_ranks(comm, q.detach(), p.detach(), atol=1e-12, what=name)
