"""`fit` itself in one process: argument checks, the history, eval, and the returned model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpitrain.fit import FitError, FitResult, fit


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def data(n_batches: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n_batches)]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def test_unknown_strategy_metric_or_epochs_raise_fit_error_naming_the_choices():
    with pytest.raises(FitError, match="unknown strategy 'magic'"):
        fit(mlp(), data(1), nn.CrossEntropyLoss(), sgd, strategy="magic", progress=False)
    with pytest.raises(FitError, match="unknown metric"):
        fit(mlp(), data(1), nn.CrossEntropyLoss(), sgd, strategy="model", metrics=["f1"], progress=False)
    with pytest.raises(FitError, match="epochs must be"):
        fit(mlp(), data(1), nn.CrossEntropyLoss(), sgd, strategy="model", epochs=0, progress=False)


def test_one_rank_model_strategy_equals_plain_training_and_history_has_each_epoch():
    model, batches, held_out = mlp(), data(4), data(2, seed=1)
    ref = copy.deepcopy(model)
    opt = sgd(ref.parameters())
    losses = []
    for _ in range(2):
        total = 0.0
        for x, y in batches[:3]:
            opt.zero_grad()
            loss = nn.CrossEntropyLoss()(ref(x), y)
            loss.backward()
            opt.step()
            total += loss.item()
        losses.append(total / 3)
    result = fit(model, batches, nn.CrossEntropyLoss(), sgd, strategy="model", epochs=2, steps=3,
                 eval_data=held_out, metrics=["accuracy"], progress=False, micro_batches=2)
    assert isinstance(result, FitResult) and isinstance(result.model, nn.Sequential)
    assert [h["epoch"] for h in result.history] == [1.0, 2.0]
    assert [h["loss"] for h in result.history] == pytest.approx(losses, abs=1e-6)
    for a, b in zip(result.model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    with torch.no_grad():
        acc = sum((ref(x).argmax(1) == y).sum().item() for x, y in held_out) / 16
    assert result.history[-1]["eval_accuracy"] == pytest.approx(acc)
    assert result.history[-1]["samples_per_s"] > 0


class Scaled(nn.Module):
    """forward has a defaulted argument the data does not supply."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * scale)


def test_forward_defaults_are_used_when_the_data_gives_fewer_inputs():
    torch.manual_seed(0)
    model = Scaled()
    ref = copy.deepcopy(model)
    result = fit(model, data(1), nn.CrossEntropyLoss(), sgd, strategy="model", progress=False)
    opt = sgd(ref.parameters())
    x, y = data(1)[0]
    nn.CrossEntropyLoss()(ref(x), y).backward()
    opt.step()
    for a, b in zip(result.model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
