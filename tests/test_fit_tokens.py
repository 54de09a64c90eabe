"""Token-level losses under fit (MPI, 2-4 ranks): a language model's token-mean loss over labels with
ignored positions (-100) trains exactly as ONE process computing the mean over every counted token of the
step, under data, model (2 micro-batches), hybrid (2x2 at 4 ranks) and accumulate=2 -- also when some
rank's (micro-batch's, replica's) rows hold no counted token (its loss alone is 0/0 = NaN) -- and the
recorded step loss and ``eval_loss`` are that global token mean. Both the model's own loss (GPT-2's
``out.loss``, which shifts the labels by one), ``nn.CrossEntropyLoss`` on the logits (targets as given),
and the same token mean written out (whose gradient, unlike torch's fused one, is NaN on a share keeping
no token).
Float64 models; the model's own loss is computed in float32 by transformers (``logits.float()``): 1e-7
there, 1e-10 with the cross-entropy on float64 logits."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from mpitrain.fit import fit
from tests.helpers import assert_all_ranks, assert_close_all_ranks
from tests.strategies.pipeline.tiny_transformers import build, lm_batches, own_loss

pytestmark = pytest.mark.mpi

B = 6  # rows per global batch: at 4 ranks shares of 2, 2, 1, 1


class LogitsCE(nn.CrossEntropyLoss):
    """``nn.CrossEntropyLoss`` (token mean, ``ignore_index=-100``) on a causal LM's ``(B, T, V)`` logits
    against ``(B, T)`` targets, as given (no shift)."""

    def forward(self, out: Any, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = out.logits
        return super().forward(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class WrittenOutCE(nn.Module):
    """The same token mean written out, ``sum(per-token CE * kept) / kept.sum()``: unlike torch's fused
    cross-entropy (whose backward gives 0 when nothing is kept), a share keeping no token back-propagates
    0 * d(x / 0) = NaN into every gradient if it is back-propagated at all."""

    ignore_index = -100

    def forward(self, out: Any, targets: torch.Tensor) -> torch.Tensor:
        logits, targets = out.logits.reshape(-1, out.logits.shape[-1]), targets.reshape(-1)
        kept = targets != self.ignore_index
        per_token = nn.functional.cross_entropy(logits, targets.clamp(min=0), reduction="none")
        return (per_token * kept).sum() / kept.sum()


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def token_batches(own: bool, empty: bool, steps: int = 4) -> list[dict[str, torch.Tensor]]:
    """Global batches of B rows, padded tails labelled -100 (uneven counts per row); with `empty`, the
    last half of the first batch's rows labelled -100 throughout: no counted token on the last rank at 2
    and 3 ranks, on the last two at 4, in the data strategy's last micro-batch and the hybrid's second
    replica. `own`: the labels among the inputs (the model computes its loss), else a separate
    ``"targets"`` entry."""
    out = []
    for i, (inputs, targets) in enumerate(lm_batches(B, steps, seed=7, mask=True, labels=True)):
        targets = targets.clone()
        if empty and i == 0:
            targets[B // 2:] = -100
        batch = {k: v for k, v in inputs.items() if k != "labels"}
        batch["labels" if own else "targets"] = targets
        out.append(batch)
    return out


def as_fit_data(batches: list[dict[str, torch.Tensor]], own: bool) -> list[Any]:
    if own:
        return batches  # mappings holding labels: the model gets them, the targets are batch["labels"]
    return [({k: v for k, v in b.items() if k != "targets"}, b["targets"]) for b in batches]


def one_process(model: nn.Module, batches: list[dict[str, torch.Tensor]], own: bool,
                accumulate: int) -> tuple[nn.Module, list[float]]:
    """One process: each step's global batch (`accumulate` batches concatenated), its loss the mean over
    every counted token of the step (``model(**batch).loss``, or the cross-entropy on the logits)."""
    model = copy.deepcopy(model)
    opt, ce, losses = sgd(model.parameters()), LogitsCE(), []
    for s in range(0, len(batches), accumulate):
        group = batches[s:s + accumulate]
        batch = {k: torch.cat([b[k] for b in group]) for k in group[0]}
        opt.zero_grad()
        if own:
            loss = model(**batch).loss
        else:
            loss = ce(model(**{k: v for k, v in batch.items() if k != "targets"}), batch["targets"])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def layouts(comm) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"strategy": "data"},
        {"strategy": "data", "accumulate": 2},
        {"strategy": "model", "partitions": comm.size, "micro_batches": 2, "balance": "params"},
    ]
    if comm.size == 4:
        out.append({"strategy": "hybrid", "partitions": 2, "replicas": 2, "micro_batches": 2, "balance": "params"})
    return out


@pytest.mark.parametrize(("loss", "empty"), [("out.loss", False), ("out.loss", True), ("CrossEntropyLoss", False),
                                           ("CrossEntropyLoss", True), ("written-out", True)])
def test_token_mean_losses_train_and_record_like_one_process(comm, loss, empty):
    own = loss == "out.loss"
    batches = token_batches(own, empty)
    atol = 1e-7 if own else 1e-10
    loss_atol = 2e-6 if own else 1e-10  # a float32 loss of ~4.6: its ulp is 4.8e-7
    loss_fn = own_loss if own else LogitsCE() if loss == "CrossEntropyLoss" else WrittenOutCE()
    for opts in layouts(comm):
        accumulate = opts.get("accumulate", 1)
        want, want_losses = one_process(build("gpt2"), batches, own, accumulate)
        seen: list[float] = []
        result = fit(build("gpt2"), as_fit_data(batches, own), loss_fn, sgd, progress=False,
                     on_step_end=lambda state, seen=seen: seen.append(state.loss), **opts)
        what = f"{opts}, {loss}, {'empty share' if empty else 'padded'}"
        for (name, a), b in zip(result.model.named_parameters(), want.parameters()):
            assert_all_ranks(comm, bool(torch.isfinite(a).all()), f"{what}: {name} holds NaN or inf")
            assert_close_all_ranks(comm, a.detach(), b.detach(), atol=atol, what=f"{what}: {name}")
        assert_all_ranks(comm, len(seen) == len(want_losses), f"{what}: steps {len(seen)}")
        for got, exp in zip(seen, want_losses):
            assert_all_ranks(comm, abs(got - exp) < loss_atol, f"{what}: step loss {got} vs one process {exp}")


@pytest.mark.parametrize("strategy", ["data", "model"])
def test_eval_loss_of_the_models_own_token_mean_is_the_global_token_mean(comm, strategy):
    """eval_data with ``out.loss``: one batch of B rows whose last half counts no token (NaN on those
    ranks or micro-batches alone): eval_loss is one process's mean over the batch's counted tokens."""
    batches = token_batches(own=True, empty=True, steps=2)
    opts = {} if strategy == "data" else {"partitions": comm.size, "micro_batches": 2, "balance": "params"}
    result = fit(build("gpt2"), batches[1:], own_loss, sgd, strategy=strategy, eval_data=batches[:1],
                 progress=False, **opts)
    with torch.no_grad():
        model = result.model.eval()
        want = model(**batches[0]).loss.item()
    got = result.history[-1]["eval_loss"]
    assert_all_ranks(comm, abs(got - want) < 2e-6, f"{strategy}: eval loss {got} vs one process {want}")


def eval_batches(own: bool) -> list[dict[str, torch.Tensor]]:
    """Three eval batches of 6, 5 and 3 rows counting very different numbers of tokens (the first keeps
    none in its last 4 rows), so weighting them by rows, not by counted tokens, gives another mean."""
    out = []
    for i, rows in enumerate((6, 5, 3)):
        (inputs, targets), = lm_batches(rows, 1, seed=11 + i, mask=True, labels=True)
        targets = targets.clone()
        if i == 0:
            targets[2:] = -100
        batch = {k: v for k, v in inputs.items() if k != "labels"}
        batch["labels" if own else "targets"] = targets
        out.append(batch)
    return out


@pytest.mark.parametrize("loss", ["out.loss", "CrossEntropyLoss"])
def test_eval_loss_over_several_batches_is_the_global_token_mean(comm, loss):
    """eval_data of three batches with different counted tokens: ``eval_loss`` is ONE process's mean over
    every counted token of all three together (``out.loss`` shifts the labels by one, the cross-entropy
    takes them as given), under data, model (2 micro-batches) and hybrid (2x2 at 4 ranks); not the mean of
    the batches' means weighted by rows."""
    own = loss == "out.loss"
    evals = eval_batches(own)
    loss_fn = own_loss if own else LogitsCE()
    whole = {k: torch.cat([b[k] for b in evals]) for k in evals[0]}
    for opts in layouts(comm):
        if opts.get("accumulate"):
            continue
        result = fit(build("gpt2"), as_fit_data(token_batches(own, False, steps=1), own), loss_fn, sgd,
                     eval_data=as_fit_data(evals, own), progress=False, **opts)
        with torch.no_grad():
            model = result.model.eval()
            out = model(**{k: v for k, v in whole.items() if k != "targets"})
            target = whole["labels" if own else "targets"]
            want = (out.loss if own else LogitsCE()(out, target)).item()
        got = result.history[-1]["eval_loss"]
        assert_all_ranks(comm, abs(got - want) < 2e-6, f"{opts}, {loss}: eval loss {got} vs one process {want}")
