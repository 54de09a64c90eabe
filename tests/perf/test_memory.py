"""Tensor-level step memory: the peak rise of live tensor bytes during a call, from allocator events."""

from __future__ import annotations

import torch

from mpitrain.perf.memory import step_memory

MIB = 1 << 20


def test_peak_counts_a_temporary_that_is_freed_before_the_call_returns():
    def fn():
        a = torch.empty(4 * MIB, dtype=torch.uint8)
        b = torch.empty(2 * MIB, dtype=torch.uint8)
        del a, b

    peak = step_memory(fn)
    assert 6 * MIB <= peak < 6 * MIB + 64 * 1024


def test_peak_is_the_maximum_level_not_the_sum_of_allocations():
    def fn():
        for _ in range(5):
            t = torch.empty(3 * MIB, dtype=torch.uint8)
            del t

    assert 3 * MIB <= step_memory(fn) < 4 * MIB


def test_tensors_alive_before_the_call_are_not_counted():
    held = torch.ones(8 * MIB, dtype=torch.uint8)
    assert step_memory(lambda: held.add_(1)) < 64 * 1024
