"""The sharding rule of strategies/_batching: the inputs' dim 0 is the batch; targets k rows per sample."""

from __future__ import annotations

from collections import UserDict

import pytest
import torch

from mpitrain.strategies._batching import (
    batch_size,
    call_args,
    per_sample,
    plain_inputs,
    samples,
    slice_share,
    split_pairs,
    target_rows,
)
from mpitrain.strategies.base import FitError, Share


def lm_batch(b: int = 4, t: int = 3) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids = torch.arange(b * t).reshape(b, t)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids.reshape(-1)


def test_batch_size_is_the_inputs_dim0_and_flattened_targets_count_k_rows_per_sample():
    inputs, targets = lm_batch()
    assert samples(inputs, targets) == 4 and per_sample(4, targets) == 3
    assert samples(inputs, targets[:4]) == 4 and per_sample(4, targets[:4]) == 1


def test_a_mapping_that_is_not_a_dict_is_taken_as_its_dict():
    """A tokenizer's BatchEncoding is a UserDict: pytree sees one leaf in it, its dict is the batch."""
    inputs, targets = lm_batch()
    encoding = UserDict(inputs)
    with pytest.raises(FitError, match="no tensor with a batch dimension"):
        batch_size(encoding)
    plain = plain_inputs(encoding)
    assert type(plain) is dict and plain.keys() == inputs.keys() and call_args(plain) == ((), inputs)
    assert samples(plain, targets) == 4 and plain_inputs(inputs) is inputs


def test_target_rows_and_pairs_cut_the_targets_proportionally():
    inputs, targets = lm_batch()
    assert torch.equal(target_rows(targets, 4, 1, 3), inputs["input_ids"][1:3].reshape(-1))
    for x, y in split_pairs(inputs, targets, 3):  # blocks of 2, 1, 1 samples
        assert torch.equal(y, x["input_ids"].reshape(-1))
    share = slice_share(inputs, targets, Share(3, 4))
    assert share.n == 4 and torch.equal(share.targets, torch.tensor([9, 10, 11]))


def test_targets_that_are_no_multiple_of_the_batch_are_refused_naming_both_shapes():
    inputs, targets = lm_batch()
    with pytest.raises(FitError, match=r"\(13,\).*'input_ids': \(4, 3\).*multiple"):
        samples(inputs, torch.cat([targets, targets[:1]]))
    with pytest.raises(FitError, match="multiple"):
        samples(inputs, targets[:2])  # fewer rows than samples
