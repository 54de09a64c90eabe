"""Activation checkpointing of a Hugging Face model (``gradient_checkpointing_enable``) under the pipeline.

transformers' default (``use_reentrant=False``) trains under "model" exactly as one process does (float64,
parameters after 2 steps). ``use_reentrant=True`` runs each layer under ``no_grad`` inside an
autograd.Function that torch.export does not keep: the captured graph would train nothing inside those
layers (the last partition's loss had no grad_fn: one rank raised, the others waited in the tied-weight
allreduce until the job's stall limit). It is refused with FitError on every rank before any message."""

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


def one_process(model: nn.Module, batches) -> nn.Module:
    """The same training in one process: lm_loss of the whole batch, one SGD step per batch."""
    model = copy.deepcopy(model)
    model.train()
    opt = sgd(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        lm_loss(model(**x), y).backward()
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
