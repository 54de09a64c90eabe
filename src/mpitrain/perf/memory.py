"""Tensor-level memory accounting: the peak of live tensor bytes that one call adds, from the allocator."""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

__all__ = ["step_memory"]


def step_memory(fn: Callable[[], object]) -> int:
    """Bytes by which the live tensors (CPU allocator) of this process rise at their peak during `fn()`.

    Counts every block `fn` allocates while it runs (activations saved for backward, gradients, halo
    and message buffers, kernel workspaces), minus those it frees again. Blocks that existed before the
    call (model, input batch, last step's gradients) are not counted, nor is their freeing: the
    profiler cannot size a block allocated before it started. Unlike the resident set it does not
    depend on how malloc keeps or returns freed memory, so runs compare exactly. Read from the
    profiler's allocation events (``profile_memory=True``), which slows `fn`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "memory block of unknown size": see above
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    level = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        level += e.nbytes()
        peak = max(peak, level)
    return peak
