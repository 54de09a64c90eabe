"""Hugging Face-style data in fit (the one rule of ``mpitrain.strategies.split_batch``): a map-style Dataset whose
items are mappings holding "labels" (``{"input_ids", "attention_mask", "labels"}``, as a tokenized HF
dataset gives them), with the default collate or a padding ``collate_fn`` for variable lengths, and a list
of such already-collated batches. The model is called with every key, labels included, and trains on its
own ``out.loss``. Parameters after 2 steps equal one process's (float64) under data and model at 2, 3 and 4
ranks; items or batches without "labels" are refused with FitError on every rank before any message.

Tiny GPT-2 from its default config (tests/strategies/pipeline/tiny_transformers.py): the sequence
classifier (labels: one class per item, an int) and the LM head (labels: (T,) tokens per item)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, default_collate

from mpitrain.fit import FitError, fit
from tests.helpers import assert_all_ranks, assert_close_all_ranks
from tests.strategies.pipeline.tiny_transformers import LABELS, PAD, VOCAB, build, lm_batches, own_loss

pytestmark = pytest.mark.mpi

N, B, SEED = 12, 6, 3  # 2 steps of 6 items; at 4 ranks shares of 2, 2, 1, 1


class Tokenized(Dataset):
    """N tokenized items ``{"input_ids": (T,), "attention_mask": (T,), "labels": int}`` (T cycling through
    `lengths`; no pad token inside an item, as a tokenizer gives them before padding)."""

    def __init__(self, lengths: tuple[int, ...] = (8,), labels: bool = True) -> None:
        g = torch.Generator().manual_seed(11)
        self.reads: list[int] = []
        self.items: list[dict[str, Any]] = []
        for i in range(N):
            t = lengths[i % len(lengths)]
            item: dict[str, Any] = {"input_ids": torch.randint(PAD + 1, VOCAB, (t,), generator=g),
                                    "attention_mask": torch.ones(t, dtype=torch.long)}
            if labels:
                item["labels"] = int(torch.randint(0, LABELS, (), generator=g))
            self.items.append(item)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.reads.append(int(i))
        return self.items[i]


def pad_collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-pads input_ids with PAD and attention_mask with 0 to the longest item (what
    ``transformers.DataCollatorWithPadding`` does), labels stacked."""
    longest = max(len(it["input_ids"]) for it in items)
    def pad(key: str, value: int) -> torch.Tensor:
        return torch.stack([F.pad(it[key], (0, longest - len(it[key])), value=value) for it in items])
    return {"input_ids": pad("input_ids", PAD), "attention_mask": pad("attention_mask", 0),
            "labels": torch.tensor([it["labels"] for it in items])}


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def one_process(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> nn.Module:
    """The same training in one process: model(**batch).loss, one SGD step per batch."""
    model = copy.deepcopy(model)
    opt = sgd(model.parameters())
    for batch in batches:
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    return model


def dataset_batches(ds: Tokenized, collate=default_collate) -> list[dict[str, torch.Tensor]]:
    """The global batches fit's order rule visits (epoch 0, shuffled with `SEED`), collated in one process."""
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED)).tolist()
    return [collate([ds[i] for i in order[s:s + B]]) for s in range(0, N, B)]


def options(comm, strategy: str) -> dict[str, Any]:
    return {} if strategy == "data" else {"partitions": comm.size, "micro_batches": 2, "balance": "params"}


def compare(comm, got: nn.Module, want: nn.Module, what: str, atol: float) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        assert_close_all_ranks(comm, a.detach(), b.detach(), atol=atol, what=f"{what}: {name}")


@pytest.mark.parametrize("strategy", ["data", "model"])
def test_dataset_of_dict_items_with_labels_trains_and_evaluates_like_one_process(comm, strategy):
    """Also eval_data with the model's own loss: batches of 5 and 1 items (ranks without rows), whose
    eval loss is the mean over all items, as one process computes it."""
    ds = Tokenized()
    want = one_process(build("gpt2", classify=True), dataset_batches(ds))
    evaluate = [default_collate(ds.items[:5]), default_collate(ds.items[5:6])]
    result = fit(build("gpt2", classify=True), ds, own_loss, sgd, strategy=strategy, batch_size=B, seed=SEED,
                 eval_data=evaluate, progress=False, **options(comm, strategy))
    compare(comm, result.model, want, f"dict items, {strategy}", 1e-10)
    with torch.no_grad():
        want.eval()
        eval_want = (want(**evaluate[0]).loss.item() * 5 + want(**evaluate[1]).loss.item()) / 6
    got = result.history[-1]["eval_loss"]
    assert_all_ranks(comm, abs(got - eval_want) < 1e-10, f"eval loss {got} vs one process {eval_want}")


@pytest.mark.parametrize("strategy", ["data", "model"])
def test_variable_length_items_train_with_a_padding_collate_fn_like_one_process(comm, strategy):
    """Each rank collates its own rows (padded to their own longest); the classifier's outputs per item
    do not depend on the padding, so the step equals one process padding the whole batch."""
    ds = Tokenized(lengths=(5, 8, 6, 7, 3))
    want = one_process(build("gpt2", classify=True), dataset_batches(ds, pad_collate))
    result = fit(build("gpt2", classify=True), ds, own_loss, sgd, strategy=strategy, batch_size=B, seed=SEED,
                 collate_fn=pad_collate, progress=False, **options(comm, strategy))
    compare(comm, result.model, want, f"padded items, {strategy}", 1e-10)


@pytest.mark.parametrize("strategy, loss", [("data", own_loss), ("data", None), ("model", None)],
                         ids=["data-out.loss", "data-None", "model-None"])
def test_list_of_collated_dict_batches_with_labels_trains_like_one_process(comm, strategy, loss):
    """A list of global batches ``{"input_ids": (B, T), "labels": (B, T)}`` (the LM head: labels per
    token, the (B, T) target rule), on ``out.loss`` written out or ``loss_fn=None`` (the model's own loss,
    as Trainer trains: the same function for fit). The model's own LM loss is computed in float32
    (transformers' ``logits.float()``), so each share's loss scale rounds there: 1e-7."""
    batches = [x for x, _ in lm_batches(B, 2, seed=4, mask=False, labels=True)]
    want = one_process(build("gpt2"), batches)
    result = fit(build("gpt2"), batches, loss, sgd, strategy=strategy, progress=False, **options(comm, strategy))
    compare(comm, result.model, want, f"list of dict batches, {strategy}", 1e-7)


@pytest.mark.parametrize("strategy", ["data", "model"])
def test_loss_fn_none_without_labels_in_the_inputs_names_the_fix_and_a_bad_loss_fn_is_refused(comm, strategy):
    """The model's own loss needs labels among its inputs: a (inputs, target) tuple gives it none, and
    every rank ends with FitError naming the fix (data: each rank's forward; model: the last stage's, the
    others stopped by fit's closing of the pipeline). A loss_fn that is no callable is refused first."""
    x, _ = lm_batches(B, 1, seed=4, mask=False, labels=True)[0]
    with pytest.raises(FitError, match="must be a callable"):
        fit(build("gpt2"), [(x["input_ids"], x["labels"])], "out.loss", sgd, strategy=strategy, progress=False,
            **options(comm, strategy))
    if strategy == "model":
        return
    with pytest.raises(FitError, match='without one: give the data a "labels" key, or pass loss_fn'):
        fit(build("gpt2"), [(x["input_ids"], x["labels"])], None, sgd, strategy=strategy, progress=False)


@pytest.mark.parametrize("strategy", ["data", "model"])
@pytest.mark.parametrize("kind", ["dataset", "list"])
def test_items_without_labels_are_refused_on_every_rank_before_any_message(comm, strategy, kind):
    ds = Tokenized(labels=False)
    data: Any = ds if kind == "dataset" else [default_collate(ds.items[:B])]
    kwargs = {"batch_size": B} if kind == "dataset" else {}
    try:
        fit(build("gpt2", classify=True), data, own_loss, sgd, strategy=strategy, progress=False, **kwargs,
            **options(comm, strategy))
        ok, msg = False, "no error"
    except FitError as e:
        msg = str(e)
        ok = '"labels"' in msg and "(inputs, target)" in msg and "attention_mask" in msg
    assert_all_ranks(comm, ok, msg)
    # refused before the trainer was built: the Dataset was read only by the check of item 0, no DataLoader
    assert_all_ranks(comm, ds.reads == ([0] if kind == "dataset" else []), f"reads {ds.reads}")
    t = torch.ones(2)  # nothing was sent: the next collective still matches on every rank
    comm.allreduce(t)
    assert_all_ranks(comm, torch.equal(t, torch.full((2,), float(comm.size))), "desynchronised")


def one_process_autocast(model: nn.Module, batches: list[dict[str, torch.Tensor]], precision: str) -> nn.Module:
    """:func:`one_process` under ``torch.autocast("cpu", bf16 / fp16)``, fp16 with a GradScaler (init 2**8)."""
    model = copy.deepcopy(model)
    opt = sgd(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if precision == "fp16" else None
    for batch in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16 if scaler else torch.bfloat16):
            loss = model(**batch).loss
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return model


@pytest.mark.parametrize("precision, atol", [("bf16", 2e-3), ("fp16", 5e-4)])  # measured 4.3e-4, 6.2e-5
def test_a_language_model_trains_in_low_precision_across_partitions_like_one_process_autocast(comm, precision, atol):
    """GPT-2 casts its logits to float32 before its own loss (``logits.float()``): torch.export recorded the
    float32 it saw as an assert, and every partition graph failed under fit's autocast ("Tensor dtype
    mismatch"). The casts stay in the graph, so the partitions compute what the forward computes under
    autocast: equal to one process's autocast loop (float32 weights) to the precision's rounding, further
    than which the two steps move the weights."""
    batches = [x for x, _ in lm_batches(B, 2, seed=4, mask=False, labels=True)]
    start = build("gpt2").float()
    want = one_process_autocast(start, batches, precision)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if precision == "fp16" else None
    result = fit(copy.deepcopy(start), batches, None, sgd, strategy="model", precision=precision, grad_scaler=scaler,
                 progress=False, **options(comm, "model"))
    compare(comm, result.model, want, f"{precision} under model", atol)
    moved = max((a - b).abs().max().item() for a, b in zip(want.parameters(), start.parameters()))
    assert_all_ranks(comm, moved > 10 * atol, f"the steps moved the weights by {moved} only (the test can fail)")


@pytest.mark.parametrize("strategy", ["data", "model"])
def test_eval_of_a_default_config_with_dropout_equals_model_eval_in_one_process(comm, strategy):
    """GPT-2's default config drops out (0.1), also inside its attention: sdpa's ``dropout_p`` is chosen by
    ``self.training`` in Python while torch.export captures the model, so the partitions' eval switch of
    the dropout ops did not reach it and eval_loss under model was noisy (4.6238 vs 4.6230). With lr 0
    the weights stay as built, and fit's eval_loss equals one process's ``model.eval()`` loss (2e-6: the
    model's own loss is float32, and the ranks' shares of it are averaged; dropout moved it by 7.6e-4)."""
    batches = [x for x, _ in lm_batches(B, 1, seed=4, mask=False, labels=True)]
    start = build("gpt2", dropout=True)
    result = fit(copy.deepcopy(start), batches, None, lambda ps: torch.optim.SGD(ps, lr=0.0), strategy=strategy,
                 eval_data=batches, progress=False, **options(comm, strategy))
    with torch.no_grad():
        want = start.eval()(**batches[0]).loss.item()
    got = result.history[-1]["eval_loss"]
    assert_all_ranks(comm, abs(got - want) < 2e-6, f"eval loss {got} vs one process's model.eval() {want}")
