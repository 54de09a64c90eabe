"""fit's data rules (src/mpitrain/_data.py) on their own: the first-batch fingerprint, the batch count, what a
map-style Dataset is, the one rule for samples and batches (its Hugging Face label names), the seeded collate."""

from __future__ import annotations

import random

import pytest
import torch

from mpitrain._data import FINGERPRINT_ELEMENTS, DataPlan, _spread, batch_checksum, batch_count, global_batches
from mpitrain.fit import FitError


def test_fingerprint_reads_a_bounded_sample_from_every_row():
    """A ResNet-50-sized batch is fingerprinted from about FINGERPRINT_ELEMENTS elements, some in every
    row, and a small tensor from all of its elements."""
    x = torch.arange(64 * 3 * 224 * 224, dtype=torch.float32).reshape(64, 3, 224, 224)
    picked = _spread(x)
    assert picked.numel() <= FINGERPRINT_ELEMENTS
    rows = (picked // (3 * 224 * 224)).long()
    assert torch.equal(rows.unique(), torch.arange(64))
    small = torch.randn(8, 6)
    assert torch.equal(_spread(small), small.reshape(-1))
    tall = torch.arange(3 * FINGERPRINT_ELEMENTS).reshape(-1, 3)  # more rows than the limit: rows spread too
    assert _spread(tall).numel() == FINGERPRINT_ELEMENTS


def test_fingerprint_tells_other_order_rows_and_dtypes_apart_and_equal_batches_alike():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    base = batch_checksum((x, y))
    assert batch_checksum((x.clone(), y.clone())) == base
    assert batch_checksum((x[torch.randperm(64, generator=g)], y)) != base  # another shuffle
    other = x.clone()
    other[17] = torch.randn(3, 32, 32, generator=g)  # one sample replaced
    assert batch_checksum((other, y)) != base
    assert batch_checksum((x.double(), y)) != base
    assert batch_checksum(({"ids": y, "flag": True}, y)) != batch_checksum(({"ids": y, "flag": False}, y))
    odd = (torch.zeros(0, 3), torch.tensor(2.0), torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bfloat16))
    assert batch_checksum(odd) == batch_checksum(tuple(t.clone() for t in odd))


def test_batch_count_is_the_number_of_global_batches():
    for n in (1, 7, 8, 9, 16, 17):
        for drop_last in (False, True):
            assert batch_count(n, 8, drop_last) == len(global_batches(torch.arange(n), 8, drop_last))


# -- what a sample or batch is, what a map-style Dataset is, and the seeded collate (Hugging Face's data) ----

class _MapProtocol:
    """The map-style protocol without torch's class (as a Hugging Face ``datasets.Dataset``)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((2,), float(i)), i


class _TorchMap(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_a_map_style_dataset_is_a_torch_one_or_the_protocol_and_never_a_list_of_batches():
    from mpitrain._data import is_map_dataset

    batches = [(torch.zeros(2, 3), torch.zeros(2))]
    assert is_map_dataset(_TorchMap()) and is_map_dataset(_MapProtocol())
    for data in (batches, tuple(batches), range(3), {"a": 1}, torch.zeros(4, 3), _Stream(),
                 torch.utils.data.DataLoader(_TorchMap(), batch_size=2), iter(batches), "text"):
        assert not is_map_dataset(data), type(data).__name__


def test_hugging_face_datasets_are_map_style_and_their_iterable_form_is_not():
    datasets = pytest.importorskip("datasets")
    from mpitrain._data import is_map_dataset

    ds = datasets.Dataset.from_dict({"x": [[1.0, 2.0]] * 3, "label": [0, 1, 0]}).with_format("torch")
    assert is_map_dataset(ds) and not is_map_dataset(ds.to_iterable_dataset())


def test_split_batch_renames_hugging_faces_label_columns_labels_and_keeps_labels_first():
    from mpitrain.strategies import split_batch

    ids, y = torch.ones(2, 3), torch.tensor([0, 1])
    for key in ("label", "label_ids"):
        inputs, target = split_batch({"input_ids": ids, key: y})
        assert set(inputs) == {"input_ids", "labels"} and target is y and inputs["labels"] is y
    inputs, target = split_batch({"input_ids": ids, "labels": y, "label": y + 5})  # "labels" wins, nothing renamed
    assert target is y and inputs["label"] is not y
    with pytest.raises(FitError, match='"label" or "label_ids"'):
        split_batch({"input_ids": ids})


def _masking(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A random collate drawing from torch's and Python's global RNGs (as a masked-LM collator does)."""
    x = torch.stack(items)
    return {"x": x, "labels": torch.bernoulli(torch.full_like(x, 0.5)) + random.random()}


def _plan(workers: int) -> DataPlan:
    data = [torch.full((3,), float(i)) for i in range(10)]
    return DataPlan(data, 4, True, 7, False, workers, False, _masking)


def test_a_collate_is_seeded_by_the_place_of_its_rows_and_leaves_the_global_rngs_alone():
    """The seed travels with the indices, so worker processes collate what the main process does; two
    reads of the same rows draw alike, other rows (another rank's place) differently."""
    lists, keys = [[0, 1], [2, 3], [4, 5]], [(0, 0), (0, 2), (1, 0)]
    torch.manual_seed(0)
    random.seed(0)
    main = list(_plan(0).loader(lists, 0, keys))
    after = (torch.rand(1), random.random())
    torch.manual_seed(0)
    random.seed(0)
    assert after == (torch.rand(1), random.random())  # the collate drew from its own streams
    again = list(_plan(0).loader(lists, 0, keys))
    workers = list(_plan(2).loader(lists, 0, keys))
    for a, b, c in zip(main, again, workers):
        assert torch.equal(a["labels"], b["labels"]) and torch.equal(a["labels"], c["labels"])
    assert not torch.equal(main[0]["labels"], main[1]["labels"])
    assert not torch.equal(main[0]["labels"], list(_plan(0).loader(lists[:1], 1, keys[:1]))[0]["labels"])  # epoch


class _Named(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, *, token_type_ids=None):  # noqa: ANN001, ANN201
        return input_ids


class _Kwargs(torch.nn.Module):
    def forward(self, input_ids, **kwargs):  # noqa: ANN001, ANN003, ANN201
        return input_ids


class _PositionalOnly(torch.nn.Module):
    def forward(self, x, /, mask=None, *args):  # noqa: ANN001, ANN002, ANN201
        return x


def test_unused_columns_are_those_the_forward_does_not_name_and_labels_are_kept():
    """Trainer's rule: named parameters (keyword-capable) and the three label names are kept, the rest
    dropped from a mapping (a new dict, the original untouched); anything else passes as it is."""
    from mpitrain.strategies import used_columns

    ids, y = torch.ones(2, 3), torch.tensor([0, 1])
    item = {"text": "a b", "input_ids": ids, "idx": 4, "label": y, "token_type_ids": ids, "labels": y,
            "label_ids": y, "attention_mask": ids}
    columns = used_columns(_Named())
    assert columns.check(item) == ["text", "idx"] and columns.unused(item) == ["text", "idx"]
    assert list(columns(item)) == ["input_ids", "label", "token_type_ids", "labels", "label_ids", "attention_mask"]
    assert "text" in item and columns(item)["input_ids"] is ids
    kept = {"input_ids": ids, "labels": y}
    assert columns(kept) is kept and columns((ids, y)) == (ids, y)  # nothing dropped: the same object
    assert "_Named.forward(input_ids, attention_mask, token_type_ids)" == columns.forward
    only = used_columns(_PositionalOnly())  # a positional-only name cannot be a keyword; *args none either
    assert only.unused({"x": ids, "mask": ids, "args": 1, "labels": y}) == ["x", "args"]


def test_every_column_is_kept_with_false_or_a_forward_taking_kwargs_and_a_bad_flag_is_refused():
    from mpitrain.strategies import EVERY_COLUMN, used_columns

    item = {"text": "a b", "input_ids": torch.ones(2, 3), "labels": torch.tensor([0, 1])}
    assert used_columns(_Named(), False) is EVERY_COLUMN and used_columns(_Kwargs()) is EVERY_COLUMN
    assert EVERY_COLUMN(item) is item and EVERY_COLUMN.check(item) == []
    with pytest.raises(FitError, match="remove_unused_columns must be True or False, got 'yes'"):
        used_columns(_Named(), "yes")


def test_refused_when_only_the_labels_would_be_left_naming_the_columns_and_the_forward():
    from mpitrain.strategies import used_columns

    columns = used_columns(_Named())
    with pytest.raises(FitError, match=r"\['tokens', 'idx'\] are not parameters of "
                                       r"_Named.forward\(input_ids, attention_mask, token_type_ids\)"):
        columns.check({"tokens": torch.ones(2, 3), "idx": 1, "label": torch.tensor([0, 1])})
    assert columns.check({"labels": torch.tensor([0, 1])}) == []  # nothing dropped: not this refusal


def test_wrappers_are_read_through_to_the_module_fit_calls_the_forward_of():
    """torch.compile's OptimizedModule (``(*args, **kwargs)``) by ``_orig_mod``; a Hugging Face model
    by its named parameters although its forward takes ``**kwargs`` (Trainer's reading); peft's by its
    base model (tests/test_fit_columns.py, with peft installed)."""
    from mpitrain.strategies import used_columns
    from mpitrain.strategies._batching import signature_module
    from tests.strategies.pipeline.tiny_transformers import build

    inner = _Named()
    compiled = torch.compile(inner)
    assert signature_module(compiled) is inner and used_columns(compiled).forward == used_columns(inner).forward
    bert = build("bert", classify=True)
    columns = used_columns(bert)
    assert columns.taken is not None and {"input_ids", "attention_mask", "labels"} <= columns.taken
    assert columns.unused({"input_ids": 1, "text": "a", "idx": 2, "label": 0}) == ["text", "idx"]


def test_the_seeded_collate_drops_the_columns_before_the_collate():
    """A DataPlan's loader collates items without the dropped keys (a string column would fail torch's
    collate or a padding collator); eval's loader alike."""
    from mpitrain._data import eval_loader
    from mpitrain.strategies import used_columns

    data = [{"text": ["x"] * i, "input_ids": torch.full((3,), float(i)), "labels": i} for i in range(6)]

    def strict(items: list[dict]) -> dict:
        assert all(set(it) == {"input_ids", "labels"} for it in items), [set(it) for it in items]
        return {k: torch.as_tensor([it[k] for it in items]) if k == "labels" else torch.stack([it[k] for it in items])
                for k in items[0]}

    plan = DataPlan(data, 4, True, 7, False, 0, False, strict, used_columns(_Named()))
    got = list(plan.loader([[0, 1], [2, 3, 4]], 0, [(0, 0), (0, 2)]))
    assert [b["labels"].tolist() for b in got] == [[0, 1], [2, 3, 4]]
    assert [b["labels"].tolist() for b in eval_loader(data, 4, strict, 0, used_columns(_Named()))] == [[0, 1, 2, 3],
                                                                                                      [4, 5]]
