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


def test_each_tensor_is_seeded_by_its_qualified_name_and_allocated_alone():
    """A tensor's value depends on (seed, its qualified name) only: keeping a module's bias without its
    weight allocates the bias alone and gives the whole model's bias; another seed changes every tensor;
    two equal modules under different names differ."""
    whole, other_seed = on_meta(), on_meta()
    materialize(whole)
    materialize(other_seed, seed=1)
    part = on_meta()
    assert materialize(part, keep={id(part.mid.bias)}) == ["mid"]
    assert part.mid.weight.is_meta and not part.mid.bias.is_meta
    assert torch.equal(part.mid.bias, whole.mid.bias)
    assert all(not torch.equal(a, b) for a, b in zip(whole.parameters(), other_seed.parameters()))
    with torch.device("meta"):
        twins = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    materialize(twins)
    assert not torch.equal(twins[0].weight, twins[1].weight) and not torch.equal(twins[0].bias, twins[1].bias)


def test_an_init_reading_another_tensor_is_refused_naming_the_tensor():
    class Derived(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.empty(3))
            self.b = nn.Parameter(torch.empty(3))

        def reset_parameters(self) -> None:
            nn.init.normal_(self.a)
            self.b.copy_(self.a * 2)  # b computed from a's values

    with torch.device("meta"):
        model = nn.Sequential(Derived())
    with pytest.raises(ValueError, match=r"initialising '0.b' \(Derived\) .* alone"):
        materialize(model)
