"""The sharding rule of strategies/_batching: the inputs' dim 0 is the batch; targets k rows per sample."""

from __future__ import annotations

from collections import UserDict

import pytest
import torch
from torch import nn

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


def test_counted_is_integer_targets_other_than_the_ignore_index_else_rows():
    """fit's one weighting rule (docs/training-runs.md, "Token-level losses")."""
    from mpitrain.strategies._batching import counted, ignore_index_of, label_shift

    labels = torch.tensor([[5, 6, -100], [-100, 7, 8]])
    assert counted(labels, 2, -100) == 4
    assert counted(labels, 2, -100, shift=1) == 3  # a causal LM's own loss scores labels[..., 1:]
    assert counted(labels.reshape(-1), 2, -100, shift=1) == 4  # flat targets: nothing to shift
    assert counted(labels, 2, None) == 2  # opted out: rows
    assert counted(torch.full((2, 3), -100), 2, -100) == 0
    assert counted(torch.randn(2, 3), 2, -100) == 2  # float targets: rows
    assert counted(torch.tensor([True, False]), 2, -100) == 2
    assert ignore_index_of(nn.CrossEntropyLoss(ignore_index=3)) == 3
    assert ignore_index_of(lambda out, y: out) == -100
    assert label_shift(nn.Linear(2, 2), lambda out, y: out) == 0  # not a Hugging Face causal LM


def test_zero_loss_back_propagates_zero_through_the_outputs_not_the_nan_loss():
    from mpitrain.strategies._batching import zero_loss

    lin = nn.Linear(3, 4)
    logits = lin(torch.randn(2, 3))
    targets = torch.full((2,), -100)
    kept = targets != -100  # a token mean written out (torch's own cross-entropy back-propagates 0 here)
    per_token = torch.nn.functional.cross_entropy(logits, targets.clamp(min=0), reduction="none")
    loss = (per_token * kept).sum() / kept.sum()
    assert loss.isnan()
    (loss * 0).backward(retain_graph=True)
    assert lin.weight.grad.isnan().all()  # why zero_loss exists: 0 * d(sum / 0) is NaN
    lin.zero_grad()
    zero_loss({"logits": logits, "loss": loss}, loss).backward()
    assert torch.equal(lin.weight.grad, torch.zeros_like(lin.weight))
