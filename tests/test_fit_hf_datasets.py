"""A Hugging Face fine-tuning user's data as they bring it: a ``datasets.Dataset`` built in code, tokenized
with ``.map(batched=True)``, ``remove_columns``, ``with_format("torch")``, passed straight to fit with
Hugging Face's data collators, and a tokenizer built without the hub (``tokenizers`` WordLevel in a
``PreTrainedTokenizerFast``).

* ``DataCollatorWithPadding`` (BERT sequence classifier; the raw items hold "label", the collator
  renames it) and torch's default collate on fixed-length items (the batch holds "label": fit renames it
  "labels", as Hugging Face's collators do), eval_data a ``datasets.Dataset`` too;
* ``DataCollatorForLanguageModeling(mlm=False)`` (GPT-2 on blocks of equal length, as run_clm groups
  texts): labels = input_ids;
* ``mlm=True``: random masking, each rank collating its own rows under the seed of their place
  (``_data.collate_seed``): equal to one process replaying those collates and taking the mean over every
  masked token of the step (fit's token weighting), and
  the same on a second run;
* ``to_iterable_dataset()`` with ``batch_size=``: refused on every rank, naming the DataLoader recipe,
  which trains like one process;
* ``mpitrain.plan`` with a mapping holding "labels" as its sample batch (fit's one rule, below both).

Parameters after 2 steps against one process (float64) under data and model (hybrid at 4 ranks), at 2, 3
and 4 ranks."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, default_collate

from mpitrain._data import collate_seed
from mpitrain.comm.base import split_sizes
from mpitrain.fit import FitError, fit
from mpitrain.planner import plan
from mpitrain.strategies._batching import even_share
from tests.helpers import assert_all_ranks, assert_close_all_ranks
from tests.strategies.pipeline.tiny_transformers import _transformers, build, own_loss

datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")
datasets.disable_progress_bars()

pytestmark = pytest.mark.mpi

N, B, SEED = 12, 6, 3  # 2 steps of 6 items; at 4 ranks shares of 2, 2, 1, 1
WORDS = tuple(("the a cat dog bird sat ran flew on under mat log tree big small red green old new "
               "quick slow happy sad very").split())
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # [PAD] = 0 = the tiny models' pad token


def tokenizer() -> Any:
    """A BERT-style WordLevel tokenizer over :data:`WORDS` (ids below the tiny models' vocabulary of 100),
    built in code: ``[CLS] text [SEP]``, right padding with [PAD] = 0."""
    from tokenizers import models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tk = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                      special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return _transformers().PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]",
                                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def texts(n: int = N) -> list[str]:
    """`n` sentences of 3 to 9 words (seeded)."""
    g = torch.Generator().manual_seed(5)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (3 + k % 7,), generator=g))
            for k in range(n)]


def classification(tok: Any, max_length: int | None = None) -> Any:
    """``{"text", "label"}`` tokenized as Hugging Face's examples do (``map(batched=True)``, the text column
    removed, torch format); `max_length`: padded to it in map (fixed length: no collator needed)."""
    raw = datasets.Dataset.from_dict({"text": texts(), "label": [k % 3 for k in range(N)]})
    pad = {"padding": "max_length", "max_length": max_length} if max_length else {}
    return raw.map(lambda b: tok(b["text"], **pad), batched=True, remove_columns=["text"]).with_format("torch")


def blocks(tok: Any, size: int = 8, n: int = N) -> Any:
    """run_clm's group_texts: every text's ids concatenated and cut into blocks of `size` (`n` of them)."""
    raw = datasets.Dataset.from_dict({"text": texts(3 * N)})
    ids = raw.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])

    def group(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        flat = {k: sum(v, []) for k, v in batch.items()}
        total = len(flat["input_ids"]) // size * size
        return {k: [v[i:i + size] for i in range(0, total, size)] for k, v in flat.items()}

    grouped = ids.map(group, batched=True, batch_size=len(ids))
    assert len(grouped) >= n, len(grouped)
    return grouped.select(range(n)).with_format("torch")


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def order() -> list[list[int]]:
    """fit's epoch-0 global batches (shuffled with SEED)."""
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED)).tolist()
    return [perm[s:s + B] for s in range(0, N, B)]


def renamed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {("labels" if k == "label" else k): v for k, v in batch.items()}


def one_process(model: nn.Module, ds: Any, collate) -> nn.Module:
    """Each global batch collated whole, ``model(**batch).loss``, one SGD step per batch."""
    model = copy.deepcopy(model)
    opt = sgd(model.parameters())
    for rows in order():
        opt.zero_grad()
        model(**renamed(collate([ds[i] for i in rows]))).loss.backward()
        opt.step()
    return model


def options(comm, strategy: str) -> dict[str, Any]:
    parts = {"data": 1, "model": comm.size, "hybrid": 2}[strategy]
    return {} if strategy == "data" else {"partitions": parts, "micro_batches": 2, "balance": "params"}


def compare(comm, got: nn.Module, want: nn.Module, what: str, atol: float) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        assert_close_all_ranks(comm, a.detach(), b.detach(), atol=atol, what=f"{what}: {name}")


@pytest.mark.parametrize("strategy", ["data", "model", pytest.param("hybrid", marks=pytest.mark.mpi(sizes=[4]))])
def test_a_datasets_dataset_with_data_collator_with_padding_trains_like_one_process(comm, strategy):
    """Variable-length items, each rank padding its own rows; BERT pools [CLS], so its per-item outputs
    do not depend on the padding under the attention mask."""
    tok = tokenizer()
    ds = classification(tok)
    collator = _transformers().DataCollatorWithPadding(tok)
    want = one_process(build("bert", classify=True), ds, collator)
    result = fit(build("bert", classify=True), ds, own_loss, sgd, strategy=strategy, batch_size=B, seed=SEED,
                 collate_fn=collator, progress=False, **options(comm, strategy))
    compare(comm, result.model, want, f"datasets.Dataset + DataCollatorWithPadding, {strategy}", 1e-10)


def test_label_without_a_collator_is_renamed_labels_in_training_and_evaluation(comm):
    """Fixed-length items holding "label"; torch's default collate keeps the name, fit renames it (as
    Hugging Face's default_data_collator would); eval_data a datasets.Dataset, its loss the batches' mean."""
    tok = tokenizer()
    ds = classification(tok, max_length=12)
    want = one_process(build("bert", classify=True), ds, default_collate)
    result = fit(build("bert", classify=True), ds, own_loss, sgd, batch_size=B, seed=SEED, progress=False,
                 eval_data=ds.select(range(5)))
    compare(comm, result.model, want, "label renamed", 1e-10)
    with torch.no_grad():
        want.eval()
        eval_want = want(**renamed(default_collate([ds[i] for i in range(5)]))).loss.item()
    got = result.history[-1]["eval_loss"]
    assert_all_ranks(comm, abs(got - eval_want) < 1e-10, f"eval loss {got} vs one process {eval_want}")


def test_causal_lm_blocks_with_data_collator_for_language_modeling_train_like_one_process(comm):
    """mlm=False: labels = input_ids (no pad in equal blocks): the collator makes the labels, so fit checks
    item 0 through it. The model's LM loss is computed in float32 (transformers' ``logits.float()``): 1e-7.
    (Under model the collated dict batches are test_fit_hf.py's LM case.)"""
    strategy = "data"
    tok = tokenizer()
    ds = blocks(tok)
    collator = _transformers().DataCollatorForLanguageModeling(tok, mlm=False)
    want = one_process(build("gpt2"), ds, collator)
    result = fit(build("gpt2"), ds, own_loss, sgd, strategy=strategy, batch_size=B, seed=SEED, collate_fn=collator,
                 progress=False, **options(comm, strategy))
    compare(comm, result.model, want, f"causal LM blocks, {strategy}", 1e-7)


def replay_masked(model: nn.Module, ds: Any, collator, reads: list[tuple[int, int]],
                  losses: list[tuple[int, int]]) -> nn.Module:
    """One process doing what fit promises for a random collate: rows ``[a, b)`` of each global batch (each
    of `reads`: what one rank reads) collated under ``collate_seed(SEED, 0, batch, a)``, the model's own
    loss on each of `losses` (a rank's rows, or a micro-batch's) weighted by its masked tokens: the mean
    over every masked token of the step (fit's token weighting)."""
    model = copy.deepcopy(model)
    opt = sgd(model.parameters())
    for i, rows in enumerate(order()):
        parts = {}
        for a, b in reads:
            torch.manual_seed(collate_seed(SEED, 0, i, a))
            parts[a] = collator([ds[j] for j in rows[a:b]])
        opt.zero_grad()
        pieces = []
        for a, b in losses:
            start = max(s for s in parts if s <= a)
            pieces.append({k: v[a - start:b - start] for k, v in parts[start].items()})
        counts = [int((p["labels"] != -100).sum()) for p in pieces]  # the masked tokens each loss averages
        total = sum(model(**p).loss * c for p, c in zip(pieces, counts) if c) / sum(counts)
        total.backward()
        opt.step()
    return model


@pytest.mark.parametrize("strategy", ["data", "model"])
def test_masked_lm_collator_masks_each_ranks_rows_by_their_place_and_replays_exactly(comm, strategy):
    """mlm=True draws its masks from torch's global RNG; fit seeds each collate by the rows' place in the
    global batch, so the run equals one process replaying those collates (data: each rank's share; model:
    the whole batch, read by the first stage for the inputs and the last for the labels, the loss per
    micro-batch), and (data) a second run equals the first, bit for bit."""
    tok = tokenizer()
    ds = classification(tok).remove_columns(["label"])
    collator = _transformers().DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.5)
    if strategy == "data":
        reads = losses = [(s.start, s.stop) for s in (even_share(B, comm.size, r) for r in range(comm.size))]
    else:
        reads = [(0, B)]
        losses = [(sum(split_sizes(B, 2)[:m]), sum(split_sizes(B, 2)[:m + 1])) for m in range(2)]
    want = replay_masked(build("bert"), ds, collator, reads, losses)
    runs = [fit(build("bert"), ds, own_loss, sgd, strategy=strategy, batch_size=B, seed=SEED, collate_fn=collator,
                progress=False, **options(comm, strategy)).model for _ in range(2 if strategy == "data" else 1)]
    compare(comm, runs[0], want, f"masked LM against the replay, {strategy}", 1e-7)
    for (name, a), b in zip(runs[0].named_parameters(), runs[-1].parameters()):  # data: a second run
        assert_all_ranks(comm, torch.equal(a, b), f"second run differs: {name}")
    assert_all_ranks(comm, all(torch.isfinite(p).all() for p in runs[0].parameters()), "not finite")


def test_an_iterable_dataset_with_batch_size_is_refused_and_its_dataloader_trains_like_one_process(comm):
    """With batch_size= refused before any message; without it, its first element (a sample) is refused
    as a batch, naming the same recipe, on every rank; the recipe trains like one process."""
    tok = tokenizer()
    ds = classification(tok)
    collator = _transformers().DataCollatorWithPadding(tok)
    stream = ds.to_iterable_dataset()
    try:
        fit(build("bert", classify=True), stream, own_loss, sgd, batch_size=B, collate_fn=collator, progress=False)
        ok, msg = False, "no error"
    except FitError as e:
        msg = str(e)
        ok = "IterableDataset" in msg and "DataLoader(data, batch_size=B" in msg
    assert_all_ranks(comm, ok, msg)
    try:  # without batch_size=: its elements are samples, not global batches
        fit(build("bert", classify=True), stream, own_loss, sgd, progress=False)
        ok, msg = False, "no error"
    except FitError as e:
        msg = str(e)
        ok = "seems to yield samples" in msg and "DataLoader(data, batch_size=B" in msg
    assert_all_ranks(comm, ok, msg)
    # the recipe: every rank reads the stream whole, in its order, as global batches
    loader = DataLoader(stream, batch_size=B, collate_fn=collator)
    model = build("bert", classify=True)
    opt = sgd(model.parameters())
    for start in range(0, N, B):
        opt.zero_grad()
        model(**collator([ds[i] for i in range(start, start + B)])).loss.backward()
        opt.step()
    result = fit(build("bert", classify=True), loader, own_loss, sgd, progress=False)
    compare(comm, result.model, model, "DataLoader over to_iterable_dataset()", 1e-10)


def test_plan_reads_a_mapping_holding_labels_by_fits_rule(comm, tmp_path):
    """The mapping's labels are the targets: the batch is n sequences (input_ids' dim 0), the labels'
    (n, T) rows follow it, and the model is called with every key (its own loss)."""
    tok = tokenizer()
    n = 4 * comm.size
    batch = _transformers().DataCollatorForLanguageModeling(tok, mlm=False)(list(blocks(tok, n=n)))
    folder = comm.broadcast_object(str(tmp_path), 0)
    plans = plan(build("gpt2"), batch, own_loss, comm=comm, cache=folder, strategies={"data"})
    profile = comm.broadcast_object(json.loads(next(Path(folder).glob("*.json")).read_text())["profile"]
                                    if comm.rank == 0 else None, 0)
    names = {p.strategy for p in plans}
    assert_all_ranks(comm, profile["batch"] == n and "data" in names,
                     f"batch {profile['batch']}, plans {names}, dropped {plans.dropped}")
