"""Models larger than one rank: allocate and initialise only the tensors a rank's partitions use.

A model built on the meta device (``with torch.device("meta"): model = Net()``) holds no storage. Each
rank captures and splits it on meta, then :func:`materialize` gives real storage to the modules whose
parameters or buffers its own partitions read: ``module.to_empty(recurse=False)`` and then the user's
``init_fn(module)`` or the module's own ``reset_parameters()``, under a generator seeded from
``(seed, the module's qualified name)``. A module's initial values therefore do not depend on which
rank initialises it nor on how many partitions there are; :func:`materialize` with ``keep=None``
initialises a whole one-process model identically (the reference of the tests).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["is_meta", "materialize", "module_seed"]

InitFn = Callable[[nn.Module], None]


def is_meta(model: nn.Module) -> bool:
    """True if any parameter or buffer of `model` is on the meta device."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def module_seed(seed: int, name: str) -> int:
    """The generator seed of the module called `name` (its qualified name in the model)."""
    return zlib.crc32(f"{seed}:{name}".encode())


def materialize(model: nn.Module, keep: set[int] | None = None, seed: int = 0,
                init_fn: InitFn | None = None) -> list[str]:
    """Give CPU storage to, and initialise, every module holding a meta tensor whose ``id`` is in
    `keep` (None: every meta tensor); returns the qualified names of the modules initialised.

    A tensor held by several modules (a tied weight) is initialised once, by the first holder in
    ``named_modules`` order, and the other holders are pointed at the new tensor, so the tie survives.
    Raises ValueError naming a module that has its own parameters but neither `init_fn` nor a
    ``reset_parameters`` method (pass ``init_fn``)."""
    holders: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for mod in model.modules():
        for name, t in mod._parameters.items():
            if t is not None:
                holders.setdefault(id(t), []).append((mod, name, True))
        for name, b in mod._buffers.items():
            if b is not None:
                holders.setdefault(id(b), []).append((mod, name, False))
    done: list[str] = []
    for qual, mod in model.named_modules():
        own = {name: t for name, t in [*mod._parameters.items(), *mod._buffers.items()]
               if t is not None and t.is_meta and (keep is None or id(t) in keep)}
        if not own:
            continue
        reset = getattr(mod, "reset_parameters", None)
        if init_fn is None and reset is None:
            raise ValueError(f"module {qual!r} ({type(mod).__name__}) of the meta-device model holds tensors "
                             f"but has no reset_parameters(); pass init_fn=lambda module: ... to initialise it")
        mod.to_empty(device="cpu", recurse=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(seed, qual))
            with torch.no_grad():
                if init_fn is not None:
                    init_fn(mod)
                elif reset is not None:
                    reset()
        for name, old in own.items():
            new = getattr(mod, name)
            for other, attr, is_param in holders.get(id(old), []):
                if other is not mod:  # the other ends of a tie point at the new tensor
                    (other._parameters if is_param else other._buffers)[attr] = new
        done.append(qual)
    return done
