"""Models larger than one rank: allocate and initialise only the tensors a rank's partitions use.

A model built on the meta device (``with torch.device("meta"): model = Net()``) holds no storage. Each
rank captures and splits it on meta, then :func:`materialize` gives CPU storage to exactly the
parameters and buffers its own partitions read and initialises each of them with the user's
``init_fn(module)`` or its module's own ``reset_parameters()``.

The rule (what makes the weights independent of P): every tensor is initialised **alone**, by one run
of its module's init under ``torch.manual_seed(tensor_seed(seed, qualified name))`` (e.g.
``"layers.3.0.weight"``), while every other tensor of that module is a meta placeholder (an op on meta
writes nothing and draws no random numbers). A tensor's initial value is therefore a function of
`seed`, its qualified name and its module's configuration only: not of which rank initialises it, which
other tensors that rank holds, or how many partitions there are. A module with k tensors runs its init k
times (initialisation is cheap next to training), and no rank ever holds more than the tensors it keeps.
:func:`materialize` with ``keep=None`` initialises a whole one-process model identically (the reference
of the tests). An init that computes one tensor from another's values (rare) cannot run this way and
is refused with a ValueError naming the tensor.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["is_meta", "materialize", "release", "tensor_seed"]

InitFn = Callable[[nn.Module], None]


def is_meta(model: nn.Module) -> bool:
    """True if any parameter or buffer of `model` is on the meta device."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of the parameter or buffer called `name` (its qualified name in the model)."""
    return zlib.crc32(f"{seed}:{name}".encode())


def _like(t: torch.Tensor, device: str) -> torch.Tensor:
    """An uninitialised tensor like `t` on `device`; a Parameter stays a Parameter."""
    new = torch.empty_like(t, device=device)
    return nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new


def _slots(mod: nn.Module, name: str) -> dict[str, torch.Tensor | None]:
    return mod._parameters if name in mod._parameters else mod._buffers  # type: ignore[return-value]


def _reset(mod: nn.Module) -> None:
    mod.reset_parameters()  # type: ignore[operator]


def _init_alone(mod: nn.Module, qual: str, real: dict[str, torch.Tensor], seed: int, init: InitFn) -> None:
    """Initialise each tensor of `real` (new storage for names of `mod`) in its own run of `init(mod)`,
    with every other tensor of `mod` a meta placeholder; afterwards `mod` holds the same objects as
    before (`real` holds the initialised values)."""
    before = {name: t for name, t in [*mod._parameters.items(), *mod._buffers.items()] if t is not None}
    hidden = {name: t if t.is_meta else _like(t, "meta") for name, t in before.items()}
    try:
        for name in real:
            for other, t in hidden.items():
                _slots(mod, other)[other] = real[name] if other == name else t
            full = f"{qual}.{name}" if qual else name
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(tensor_seed(seed, full))
                try:
                    with torch.no_grad():
                        init(mod)
                except (RuntimeError, NotImplementedError) as e:
                    raise ValueError(f"initialising {full!r} ({type(mod).__name__}) of the meta-device model "
                                     f"alone failed: {e}. Each tensor is initialised with the module's other "
                                     f"tensors on meta; pass init_fn= that sets each tensor from random "
                                     f"numbers or constants only") from e
            real[name] = _slots(mod, name)[name]  # type: ignore[assignment]  # the init may rebind it
    finally:
        for name, t in before.items():
            _slots(mod, name)[name] = t


def materialize(model: nn.Module, keep: set[int] | None = None, seed: int = 0,
                init_fn: InitFn | None = None) -> list[str]:
    """Give CPU storage to, and initialise, every meta parameter and buffer of `model` whose ``id`` is
    in `keep` (None: every one), each by the rule of the module docstring; the others stay on meta.
    Returns the qualified names of the modules whose tensors were initialised, in ``named_modules``
    order.

    The tensors change in place (``torch.utils.swap_tensors``): the same Parameter objects, now with
    storage, so an optimizer or a tie (several modules holding one tensor) made before still holds
    them. A tied tensor is initialised once, under the name of its first holder in ``named_modules``
    order. Raises ValueError naming a module that has its own tensors but neither `init_fn` nor a
    ``reset_parameters`` method (pass ``init_fn``)."""
    done: list[str] = []
    seen: set[int] = set()
    for qual, mod in model.named_modules():
        own = {name: t for name, t in [*mod._parameters.items(), *mod._buffers.items()]
               if t is not None and t.is_meta and (keep is None or id(t) in keep) and id(t) not in seen}
        if not own:
            continue
        init = init_fn if init_fn is not None else _reset if hasattr(mod, "reset_parameters") else None
        if init is None:
            raise ValueError(f"module {qual!r} ({type(mod).__name__}) of the meta-device model holds tensors "
                             f"but has no reset_parameters(); pass init_fn=lambda module: ... to initialise it")
        real = {name: _like(t, "cpu") for name, t in own.items()}
        _init_alone(mod, qual, real, seed, init)
        for name, t in own.items():
            torch.utils.swap_tensors(t, real[name])  # `t` (the object every holder has) gets the storage
            seen.add(id(t))
        done.append(qual)
    return done


def release(model: nn.Module, keep: set[int]) -> int:
    """Put every parameter and buffer of `model` with storage whose ``id`` is not in `keep` back on the
    meta device, in place (the same objects; ties stay ties); returns the bytes freed. The inverse of
    :func:`materialize` for a rank whose partition changed."""
    freed = 0
    for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values():
        if not t.is_meta and id(t) not in keep:
            freed += t.numel() * t.element_size()
            torch.utils.swap_tensors(t, _like(t, "meta"))
    return freed
