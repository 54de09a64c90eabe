"""Completing one request with a way out: the comm-level face of :mod:`mpitrain._utils.stall`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._utils.stall import DEFAULT_POLICY, StallPolicy, wait_until
from .base import Request

__all__ = ["wait_request", "StallPolicy", "DEFAULT_POLICY"]


def wait_request(req: Request, what: str | Callable[[], str], policy: StallPolicy = DEFAULT_POLICY,
                 who: str = "", abort: Callable[[int], None] | None = None) -> torch.Tensor | None:
    """``req.wait()`` with a way out (:func:`mpitrain._utils.stall.wait_until` polling ``req.test()``):
    every `policy.warn_after` s one line on stderr "<who>: still waiting after <N>s for <what>" (e.g.
    who="rank 0", what="recv of activation 3 of micro-batch 2 from rank 1"); after
    `policy.abort_after` s ``abort(1)``, which ends every rank (without `abort`: StallError).

    Returns what ``req.wait()`` returns (the received tensor of a receive). Only the calling rank waits;
    polls with sleeps that back off to `policy.max_nap`, so a stalled rank does not spin a core."""
    wait_until(req.test, what, policy, who=who, abort=abort)
    return req.wait()
