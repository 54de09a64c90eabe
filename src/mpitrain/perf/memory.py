"""Tensor-level memory accounting: the peak of live tensor bytes that one call adds, from the allocator."""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

__all__ = ["step_memory"]


def step_memory(fn: Callable[[], object]) -> int:
    """Bytes by which the live tensors (CPU allocator) of this process rise at their peak during `fn()`.

    Counts every tensor `fn` allocates while it runs: activations saved for backward, gradients, halo
    and message buffers, temporaries; not what existed before the call (model, input batch), except that
    a tensor freed during the call lowers the level from which later allocations count. Unlike the
    resident set it does not depend on how malloc keeps or returns freed memory, so runs compare
    exactly. Read from the profiler's allocation events (``profile_memory=True``), which slows `fn`."""
    with warnings.catch_warnings():
        # blocks allocated before the profiler started are freed "of unknown size": they only lower
        # the level, so a rise measured from the start is still exact
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    level = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        level += e.nbytes()
        peak = max(peak, level)
    return peak
