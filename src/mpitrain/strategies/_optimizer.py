"""fit's `optimizer` argument turned into the one form the strategies take: an
:data:`~.base.OptimizerFactory` ``params -> torch.optim.Optimizer``.

Users coming from DDP, Lightning or Horovod pass an optimizer INSTANCE built on their model
(``torch.optim.SGD(model.parameters(), lr=0.1)``). The strategies cannot step that object: pipeline,
ZeRO, hybrid and meta-device models build the optimizer over the parameters (or pieces) each rank
holds. :func:`optimizer_factory` rebuilds it on demand: same class, same hyperparameters per group,
the groups mapped by parameter identity onto whatever parameters a strategy hands it."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .base import FitError, OptimizerFactory

__all__ = ["optimizer_factory", "InstanceFactory", "probe_optimizer"]


def optimizer_factory(optimizer: object, model: nn.Module) -> OptimizerFactory:
    """`optimizer` as a factory: a callable is returned as is; a ``torch.optim.Optimizer`` becomes an
    :class:`InstanceFactory` (checked against `model` at once); anything else is a FitError. Local: every
    rank given the same arguments raises the same FitError, before any message."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return InstanceFactory(optimizer, model)
    if callable(optimizer):
        return optimizer
    raise FitError(f"fit: optimizer must be a torch.optim.Optimizer built on the model's parameters "
                   f"(torch.optim.SGD(model.parameters(), lr=0.1)) or a factory params -> Optimizer "
                   f"(lambda params: torch.optim.SGD(params, lr=0.1)); got {type(optimizer).__name__} "
                   f"{optimizer!r:.80}")


def _copied(value: object) -> object:
    """A hyperparameter or state value the new optimizer owns (tensors cloned: never shared with the user's)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class InstanceFactory:
    """Rebuilds the user's optimizer instance over the parameters a strategy hands it.

    Guarantees: the optimizer built is of the instance's class; group ``i`` holds, in the instance's
    order, those of its parameters that were handed, with the instance's group ``i`` hyperparameters
    (its dict minus ``"params"``: lr, momentum, ``initial_lr`` ...), so every group keeps its place even
    when empty on this rank. A parameter is recognised by identity (the model's own Parameter objects, as
    the strategies hand them; a meta model's are materialised in place) or, failing that, by its name in
    `model` at call time. State the instance holds (a stepped optimizer's, Adagrad's initial sums) is
    copied onto the new optimizer's parameters, so training continues from it. Hooks registered on the
    instance are not carried, and the instance itself is never stepped or changed.

    Refused at construction (FitError, local): a parameter of the instance that is not `model`'s; a
    trainable parameter of `model` in no group (the instance would not train it); a class that cannot be
    rebuilt from its groups."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        self.cls = type(optimizer)
        names: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)  # a tied tensor under its first name
        self._model, self._names = model, names
        held = [p for g in optimizer.param_groups for p in g["params"]]
        foreign = [tuple(p.shape) for p in held if id(p) not in names]
        if foreign:
            raise FitError(f"fit: the {self.cls.__name__} passed as optimizer holds {len(foreign)} parameter(s) that "
                           f"are not this model's (shapes {foreign[:8]}): build it on the model given to fit, e.g. "
                           f"{self.cls.__name__}(model.parameters(), ...), not on another model or a copy")
        ids = {id(p) for p in held}
        missing = sorted({names[id(p)] for p in model.parameters() if p.requires_grad and id(p) not in ids})
        if missing:
            raise FitError(f"fit: the {self.cls.__name__} passed as optimizer has no group holding the model's "
                           f"trainable parameter(s) {missing[:16]}: it would not train them; add them to a group "
                           f"or set requires_grad=False")
        #: per group: its parameters' names, in the instance's order, and its hyperparameters
        self.groups = [([names[id(p)] for p in g["params"]], {k: _copied(v) for k, v in g.items() if k != "params"})
                       for g in optimizer.param_groups]
        # the instance's own state, copied at each build (not here: a stepped Adam's state is model-sized)
        self.state = {names[id(p)]: st for p, st in optimizer.state.items() if id(p) in names}
        self.kwargs = self._constructor_kwargs(optimizer)
        try:  # built once here, so that a class that cannot be rebuilt is refused before any message
            self.build(model.parameters(), carry_state=False)
        except (TypeError, ValueError, KeyError) as e:
            raise FitError(f"fit: cannot rebuild the {self.cls.__name__} passed as optimizer from its param groups "
                           f"({e}); pass a factory instead: lambda params: {self.cls.__name__}(params, ...)") from None

    def _constructor_kwargs(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The instance's defaults that its class's constructor takes by name (e.g. SGD's `lr`, required in
        some versions); every group sets its own values explicitly, so these only satisfy the signature."""
        try:
            sig = inspect.signature(self.cls).parameters
        except (TypeError, ValueError):
            return {}
        if any(q.kind is inspect.Parameter.VAR_KEYWORD for q in sig.values()):
            return dict(optimizer.defaults)
        return {k: v for k, v in optimizer.defaults.items() if k in sig}

    def _name(self, p: nn.Parameter, current: dict[int, str]) -> str:
        name = self._names.get(id(p), current.get(id(p)))
        if name is None:  # a strategy's bug: it handed a tensor that is not the model's
            raise RuntimeError(f"optimizer: a parameter of shape {tuple(p.shape)} handed to the factory is not the "
                               f"model's")
        return name

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """A new optimizer like the instance over `params` (some or all of the model's parameters)."""
        return self.build(params)

    def build(self, params: Iterable[nn.Parameter], carry_state: bool = True) -> torch.optim.Optimizer:
        """:meth:`__call__`; ``carry_state=False`` leaves the instance's state out (the entry check)."""
        current = {id(p): name for name, p in self._model.named_parameters(remove_duplicate=False)}
        by_name = {self._name(p, current): p for p in params}
        groups = [{**{k: _copied(v) for k, v in hyper.items()}, "params": [by_name[n] for n in names if n in by_name]}
                  for names, hyper in self.groups]
        built = self.cls(groups, **self.kwargs)
        for name, st in self.state.items() if carry_state else ():
            if name in by_name:
                built.state[by_name[name]] = {k: _copied(v) for k, v in st.items()}
        return built


def probe_optimizer(factory: OptimizerFactory, model: nn.Module) -> torch.optim.Optimizer:
    """A throwaway optimizer as `factory` builds it over all of `model`'s parameters, as the strategies call
    it, for a check before any message (fit builds its LR scheduler on it to learn the scheduler's kind).
    An :class:`InstanceFactory`'s leaves the instance's state out (a model-sized copy for nothing). It is
    never stepped; the parameters are not changed."""
    if isinstance(factory, InstanceFactory):
        return factory.build(model.parameters(), carry_state=False)
    return factory(model.parameters())
