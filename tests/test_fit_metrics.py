"""fit's named metric "accuracy" reads outputs as the loss does: plain logits ``(N, C)`` and
``(N, C, H, W)``, a Hugging Face output's ``.logits``, torchvision segmentation's ``["out"]``, a tuple's
first element, ``(B, T, V)`` LM logits of ``(B, T)`` targets with -100 not counted, soft targets; and
under data and model over real MPI (2, 3, 4 ranks) eval_accuracy equals the trained model's accuracy on
the eval batches in one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mpitrain.fit import accuracy, accuracy_counted, fit
from tests.helpers import assert_all_ranks
from tests.strategies.pipeline.tiny_transformers import build, lm_batches, own_loss


# -- one process: the rule ---------------------------------------------------------------------------
def test_accuracy_takes_class_dim_1_of_plain_and_dense_logits():
    logits = torch.tensor([[1.0, 2.0], [3.0, 0.0], [0.0, 5.0]])
    assert accuracy(logits, torch.tensor([1, 1, 1])) == pytest.approx(2 / 3)
    pixels = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(0))
    target = pixels.argmax(1)
    target[0, 0, :] = (target[0, 0, :] + 1) % 3  # 5 of 40 pixels wrong
    assert accuracy(pixels, target) == pytest.approx(35 / 40)


def test_accuracy_reads_a_model_outputs_logits_or_a_tuples_first_element():
    logits, target = torch.tensor([[1.0, 2.0], [3.0, 0.0]]), torch.tensor([1, 1])
    assert accuracy(SimpleNamespace(logits=logits, loss=torch.tensor(9.0)), target) == 0.5
    assert accuracy((logits, torch.zeros(2)), target) == 0.5
    assert accuracy({"out": logits, "aux": logits.flip(1)}, target) == 0.5  # torchvision segmentation


def test_accuracy_of_lm_logits_is_per_token_without_the_ignored_ones():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1))
    target = logits.argmax(-1)
    target[0, 0] = -100  # not counted
    target[1, 2] = (target[1, 2] + 1) % 7  # one wrong of the 5 counted
    assert accuracy(logits, target) == pytest.approx(4 / 5)


class CausalLMOutputWithPast(SimpleNamespace):
    """Named as transformers' output of a causal LM."""


def test_accuracy_of_a_causal_lm_called_with_labels_compares_each_position_with_the_next_label():
    logits = torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(2))
    nxt = logits.argmax(-1)  # position t predicts label t + 1
    labels = torch.cat([torch.full((2, 1), 3), nxt[:, :-1]], 1)
    labels[1, 3] = -100  # not counted: 5 of the 6 shifted labels count, all predicted
    labels[0, 2] = (labels[0, 2] + 1) % 7  # one wrong: 4 of 5
    assert accuracy(CausalLMOutputWithPast(logits=logits, loss=torch.tensor(1.0)), labels) == pytest.approx(4 / 5)
    assert accuracy_counted(CausalLMOutputWithPast(logits=logits, loss=torch.tensor(1.0)), labels) == 5
    # without a loss the model had no labels: the targets are the user's, compared position by position
    assert accuracy_counted(CausalLMOutputWithPast(logits=logits, loss=None), labels) == 7


def test_eval_accuracy_over_batches_is_the_fraction_of_every_counted_target():
    """fit's eval record weighs each batch's accuracy by the targets it counts, not by its rows: a batch of
    one sequence with 3 counted next tokens, all right, and one with 1 counted (the rest -100), wrong, give
    3/4 (rows would give 1/2)."""
    from mpitrain.fit import _evaluate, model_loss
    from mpitrain.strategies import EVERY_COLUMN

    logits = torch.randn(1, 4, 7, generator=torch.Generator().manual_seed(3))
    nxt = logits.argmax(-1)
    right = torch.cat([torch.zeros(1, 1, dtype=torch.long), nxt[:, :-1]], 1)
    wrong = torch.tensor([[0, (int(nxt[0, 0]) + 1) % 7, -100, -100]])
    outputs = {id(right): logits, id(wrong): logits}

    class Trainer:
        def eval_step(self, inputs, targets):
            return CausalLMOutputWithPast(logits=outputs[id(targets)], loss=torch.tensor(1.0))

    batches = [{"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": y} for y in (right, wrong)]
    record = _evaluate(Trainer(), batches, model_loss, {"accuracy": accuracy}, EVERY_COLUMN)  # type: ignore[arg-type]
    assert record["eval_accuracy"] == pytest.approx(3 / 4)


def test_accuracy_of_soft_targets_counts_their_largest_class():
    logits = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    assert accuracy(logits, torch.tensor([[0.3, 0.7], [0.4, 0.6]])) == 0.5


# -- MPI: eval_accuracy is the trained model's, in one process ----------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("head, strategy", [("classifier", "model"), ("lm", "data")])
def test_eval_accuracy_of_a_hugging_face_model_is_one_process_accuracy(comm, strategy, head):
    """Eval batches of 5 and 1 sequences (ranks without rows) with the labels among the inputs (the
    model's own loss); the metric is the fraction of every counted target of the whole eval, as one
    process computes it on all the batches together (the LM's next-token accuracy: shifted labels)."""
    classify = head == "classifier"
    train = [x for x, _ in lm_batches(6, 2, seed=4, labels=True, classify=classify)]
    evaluate = [x for n in (5, 1) for x, _ in lm_batches(n, 1, seed=5 + n, labels=True, classify=classify)]
    options = {} if strategy == "data" else {"partitions": comm.size, "micro_batches": 2, "balance": "params"}
    result = fit(build("gpt2", classify=classify), train, own_loss, lambda ps: torch.optim.SGD(ps, lr=0.5),
                 strategy=strategy, eval_data=evaluate, metrics=["accuracy"], progress=False, **options)
    model = result.model.eval()
    with torch.no_grad():
        outs = [(model(**x), x["labels"]) for x in evaluate]
        want = sum(accuracy(o, y) * accuracy_counted(o, y) for o, y in outs) / sum(accuracy_counted(o, y)
                                                                                  for o, y in outs)
    got = result.history[-1]["eval_accuracy"]
    assert_all_ranks(comm, abs(got - want) < 1e-12, f"eval_accuracy {got} vs one process {want}")
