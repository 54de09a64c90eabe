"""Stall watchdog for blocking waits: warn naming the rank and what it waits for, then end the job."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .base import Request

__all__ = ["StallPolicy", "wait_watched", "DEFAULT_POLICY"]


@dataclass(frozen=True)
class StallPolicy:
    """`warn_after` seconds: print one warning; `abort_after` (None = never): print and abort the job.
    `max_nap`: the longest sleep between polls, i.e. the most latency the watchdog adds to a wait.

    The defaults suit training steps; tests and interactive runs pass smaller numbers."""

    warn_after: float = 60.0
    abort_after: float | None = 600.0
    max_nap: float = 1e-3


DEFAULT_POLICY = StallPolicy()


def wait_watched(req: Request, what: str, rank: int, abort: Callable[[int], None],
                 policy: StallPolicy = DEFAULT_POLICY) -> torch.Tensor | None:
    """``req.wait()`` with a way out: after `policy.warn_after` s one line on stderr names this `rank`
    and `what` it waits for (e.g. "recv of activation 3 of micro-batch 2 from rank 1"); after
    `policy.abort_after` s it prints again and calls `abort(1)`, which ends every rank.

    Polls ``req.test()`` with a sleep that backs off to `policy.max_nap`, so a stalled rank does not
    spin a core.
    """
    if req.test():
        return req.wait()
    start = time.monotonic()
    nap, warned = 2e-5, False
    while not req.test():
        time.sleep(nap)
        nap = min(nap * 2, policy.max_nap)
        waited = time.monotonic() - start
        if not warned and waited >= policy.warn_after:
            warned = True
            _say(f"[mpitrain] rank {rank}: still waiting after {waited:.0f}s for {what}")
        if policy.abort_after is not None and waited >= policy.abort_after:
            _say(f"[mpitrain] rank {rank}: gave up after {waited:.0f}s waiting for {what}; aborting the job")
            abort(1)
    return req.wait()


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
