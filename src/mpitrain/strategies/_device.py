"""The model's device, and what follows from it: batches moved there (as DDP does with ``device_ids``)
and bf16/fp16 autocast for that device type. For a CPU model each is one device comparison (callers on a
hot path keep ``device != CPU`` as a flag: ``torch.device.type`` costs more than the comparison)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["CPU", "model_device", "to_device", "autocast", "as_float", "LOW"]

CPU = torch.device("cpu")


def model_device(model: nn.Module) -> torch.device:
    """The device of `model`'s first parameter (else first buffer); the CPU for a model with neither."""
    first: torch.Tensor | None = next(iter(model.parameters()), None)
    if first is None:
        first = next(iter(model.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


def to_device(x: Any, device: torch.device) -> Any:
    """`x` (a tensor or any pytree of them) with its tensors on `device`: the same objects where they
    are there already (a CPU model's batch is returned as is, untouched). Copies to a CUDA device are
    asynchronous on the current stream (``non_blocking``: from pinned memory they overlap compute)."""
    if device == CPU:
        return x
    return tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, x)


def autocast(precision: str | None, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Autocast on `device`'s type: to bfloat16 when `precision` is "bf16", to float16 when "fp16"
    (fit's loss scaling is the step's: :mod:`._scaler`), else nothing."""
    low = LOW.get(precision or "")
    if low is not None:
        return torch.autocast(device.type, dtype=low)
    return contextlib.nullcontext()


#: fit's precisions that autocast, and to what
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def as_float(t: Any) -> Any:
    """`t` as float32 when it is an autocast tensor (bfloat16 or float16: an output handed back from an
    autocast forward), else `t` itself."""
    if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16):
        return t.float()
    return t
