"""Meta-device models: per-module seeded initialisation that does not depend on who initialises what."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpitrain.strategies.pipeline._materialize import is_meta, materialize


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(x)))


def on_meta() -> Tied:
    with torch.device("meta"):
        return Tied()


def test_a_module_gets_the_same_values_whoever_initialises_it_and_a_tie_survives():
    whole = on_meta()
    materialize(whole)
    part = on_meta()
    done = materialize(part, keep={id(part.head.weight)})  # only the tied weight: the first holder initialises
    assert done == ["emb"] and part.head.weight is part.emb.weight and not part.emb.weight.is_meta
    assert part.mid.weight.is_meta and is_meta(part)
    assert torch.equal(part.emb.weight, whole.emb.weight)
    assert whole.head.weight is whole.emb.weight and not is_meta(whole)


def test_a_module_without_reset_parameters_needs_init_fn():
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        model = nn.Sequential(Bare())
    with pytest.raises(ValueError, match=r"module '0' \(Bare\).*init_fn"):
        materialize(model)
    materialize(model, init_fn=lambda m: nn.init.ones_(m.w) if isinstance(m, Bare) else None)
    assert torch.equal(model[0].w, torch.ones(3))
