"""``fit(..., remove_unused_columns=True)``, Hugging Face Trainer's rule and default: a Hugging Face user's
tokenized ``datasets.Dataset`` that keeps its raw columns (``map(batched=True)`` without ``remove_columns``:
a "text" string column, GLUE's "idx" int column) trains with ``DataCollatorWithPadding`` as Trainer would
train it, the columns the model's forward does not take dropped before the collate (Dataset) or before
the split (an iterable of mapping batches).

* a BERT classifier under data, model (and hybrid at 4 ranks), eval_data a Dataset with those columns
  too: equal to one process training on the dataset with those columns removed (float64, 1e-10), the
  columns shown once, on rank 0;
* ``remove_unused_columns=False``: today's behaviour, the collator's error on the string column;
* a model whose forward takes ``**kwargs`` gets every key;
* a peft LoRA model (its own forward takes ``**kwargs``) drops by its base model's signature;
* only the labels left: FitError on every rank, naming the columns and the forward's parameters, no
  message sent (Dataset and list of batches);
* an iterable of mapping batches (a DataLoader) holding the columns, and ``plan()``'s sample batch, under
  a model whose forward names its parameters (no ``**kwargs``: an unknown key would raise).

At 2, 3 and 4 ranks."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from mpitrain.fit import FitError, fit
from mpitrain.planner import plan
from tests.helpers import assert_all_ranks, calls_recorded
from tests.strategies.pipeline.tiny_transformers import _transformers, build, own_loss
from tests.test_fit_hf_datasets import SEED, B, N, compare, datasets, one_process, options, order, sgd, texts, tokenizer

pytestmark = pytest.mark.mpi

RAW = ["text", "idx"]  # the columns the model's forward does not take


def with_columns(tok: Any) -> Any:
    """``{"text", "idx", "label"}`` tokenized as Hugging Face's examples do, keeping every raw column
    (``map(batched=True)`` without ``remove_columns``), torch format (the text stays strings)."""
    raw = datasets.Dataset.from_dict({"text": texts(), "idx": list(range(N)), "label": [k % 3 for k in range(N)]})
    return raw.map(lambda b: tok(b["text"]), batched=True).with_format("torch")


class Named(nn.Module):
    """A BERT classifier behind a forward that names its parameters (no ``**kwargs``): called with a key
    it does not take, it raises TypeError (a transformers model ignores it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build("bert", classify=True)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> Any:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                          labels=labels)


class Kwargs(Named):
    """:class:`Named` taking ``**kwargs`` too, recording every key it is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,  # type: ignore[override]
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        self.seen |= set(kwargs)
        return super().forward(input_ids, attention_mask, token_type_ids, labels)


def refused(comm, *args: Any, **kwargs: Any) -> tuple[str, list[str]]:
    """fit's FitError message (or what it raised instead) and the communicator calls made before it."""
    with calls_recorded() as calls:
        try:
            fit(*args, progress=False, comm=comm, **kwargs)
            msg = "no error"
        except FitError as e:
            msg = str(e)
        except Exception as e:  # noqa: BLE001 - the verdict must reach every rank
            msg = f"not a FitError: {type(e).__name__}: {e}"
    return msg, calls


@pytest.mark.parametrize("strategy", ["data", "model", pytest.param("hybrid", marks=pytest.mark.mpi(sizes=[4]))])
def test_text_and_idx_are_dropped_and_training_equals_one_process_without_them(comm, strategy, capsys):
    tok = tokenizer()
    ds = with_columns(tok)
    collator = _transformers().DataCollatorWithPadding(tok)
    clean = ds.remove_columns(RAW)
    want = one_process(build("bert", classify=True), clean, collator)
    capsys.readouterr()
    result = fit(build("bert", classify=True), ds, own_loss, sgd, strategy=strategy, batch_size=B, seed=SEED,
                 collate_fn=collator, eval_data=ds.select(range(5)), progress=True, **options(comm, strategy))
    compare(comm, result.model, want, f"text and idx dropped, {strategy}", 1e-10)
    with torch.no_grad():
        want.eval()
        eval_want = want(**collator([clean[i] for i in range(5)])).loss.item()
    got = result.history[-1]["eval_loss"]
    assert_all_ranks(comm, abs(got - eval_want) < 1e-10, f"eval loss {got} vs one process {eval_want}")
    shown = [line for line in capsys.readouterr().out.splitlines() if "remove_unused_columns" in line]
    ok = len(shown) == 1 and "['text', 'idx']" in shown[0] and "BertForSequenceClassification.forward(" in shown[0]
    assert_all_ranks(comm, ok if comm.rank == 0 else not shown, f"rank {comm.rank} showed {shown}")


def test_false_keeps_every_column_and_the_collator_fails_on_the_string_column_as_before(comm):
    tok = tokenizer()
    msg, _ = refused(comm, build("bert", classify=True), with_columns(tok), own_loss, sgd, batch_size=B,
                     collate_fn=_transformers().DataCollatorWithPadding(tok), remove_unused_columns=False)
    assert_all_ranks(comm, msg.startswith("not a FitError: ValueError") and "`text`" in msg, msg)


def test_a_forward_taking_kwargs_is_called_with_every_key(comm):
    tok = tokenizer()
    model = Kwargs()
    ds = with_columns(tok).remove_columns(["text"])  # idx: an int column, collated as the others
    fit(model, ds, own_loss, sgd, batch_size=B, seed=SEED, collate_fn=_transformers().DataCollatorWithPadding(tok),
        progress=False)
    assert_all_ranks(comm, model.seen == {"idx"}, f"the forward's **kwargs got {model.seen}")


def test_a_peft_lora_model_drops_by_its_base_models_signature(comm):
    """PeftModelForSequenceClassification.forward takes ``**kwargs``; the base BERT's names its columns."""
    _transformers()  # first: transformers without torchvision's C++ ops, which peft imports
    pytest.importorskip("peft")
    from tests.test_fit_peft import lora, trainable

    tok = tokenizer()
    ds = with_columns(tok)
    collator = _transformers().DataCollatorWithPadding(tok)
    start = lora("bert")
    want = copy.deepcopy(start)
    opt = sgd(trainable(want))
    clean = ds.remove_columns(RAW)
    for rows in order():
        opt.zero_grad()
        want(**collator([clean[i] for i in rows])).loss.backward()
        opt.step()
    result = fit(start, ds, own_loss, lambda p: sgd([q for q in p if q.requires_grad]), batch_size=B, seed=SEED,
                 collate_fn=collator, progress=False)
    compare(comm, result.model, want, "LoRA, text and idx dropped", 1e-10)


@pytest.mark.parametrize("kind", ["dataset", "list"])
def test_only_labels_left_is_refused_on_every_rank_before_any_message(comm, kind):
    items = [{"tokens": torch.arange(4) + k, "idx": torch.tensor(k), "label": torch.tensor(k % 3)} for k in range(N)]
    ds = datasets.Dataset.from_list([{k: v.tolist() for k, v in it.items()} for it in items]).with_format("torch")
    data: Any = ds if kind == "dataset" else [torch.utils.data.default_collate(items[:B])]
    msg, calls = refused(comm, build("bert", classify=True), data, own_loss, sgd,
                         **({"batch_size": B} if kind == "dataset" else {}))
    ok = ("['tokens', 'idx'] are not parameters of BertForSequenceClassification.forward(input_ids, attention_mask"
          in msg and "remove_unused_columns=False" in msg)
    assert_all_ranks(comm, ok, msg)
    assert_all_ranks(comm, not calls, f"sent before the refusal: {calls}")


def padded(tok: Any, collator: Any) -> Any:
    """A collate keeping the raw columns in the global batch: "text" as a list of strings, "idx" a (B,)
    tensor, the rest padded by `collator`."""
    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        batch = dict(collator([{k: v for k, v in it.items() if k not in RAW} for it in items]))
        return {**batch, "text": [it["text"] for it in items], "idx": torch.stack([it["idx"] for it in items])}
    return collate


@pytest.mark.parametrize("strategy", ["data", "model"])
def test_an_iterable_of_mapping_batches_loses_the_columns_before_the_split(comm, strategy):
    tok = tokenizer()
    ds = with_columns(tok)
    collator = _transformers().DataCollatorWithPadding(tok)
    loader = DataLoader(ds, batch_size=B, collate_fn=padded(tok, collator))
    start = Named()
    want = copy.deepcopy(start)
    opt = sgd(want.parameters())
    for batch in loader:
        opt.zero_grad()
        want(**{("labels" if k == "label" else k): v for k, v in batch.items() if k not in RAW}).loss.backward()
        opt.step()
    result = fit(start, loader, own_loss, sgd, strategy=strategy, progress=False, **options(comm, strategy))
    compare(comm, result.model, want, f"an iterable of mapping batches, {strategy}", 1e-10)


def test_plan_reads_its_sample_batch_by_the_same_rule(comm, tmp_path):
    tok = tokenizer()
    n, ds = 4 * comm.size, with_columns(tok)
    batch = padded(tok, _transformers().DataCollatorWithPadding(tok))([ds[i % N] for i in range(n)])
    folder = comm.broadcast_object(str(tmp_path), 0)
    plans = plan(Named(), batch, own_loss, comm=comm, cache=folder, strategies={"data"})
    profile = comm.broadcast_object(json.loads(next(Path(folder).glob("*.json")).read_text())["profile"]
                                    if comm.rank == 0 else None, 0)
    assert_all_ranks(comm, profile["batch"] == n and "data" in {p.strategy for p in plans},
                     f"batch {profile['batch']}, plans {[p.strategy for p in plans]}, dropped {plans.dropped}")
