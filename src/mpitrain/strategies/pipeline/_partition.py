"""Load balancing: choose P contiguous partitions of the node list that minimise the costliest one."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["balanced_bounds", "explicit_bounds", "bounds_from_balance"]


def balanced_bounds(costs: Sequence[float], cuts: Sequence[int], parts: int) -> list[int]:
    """Bounds ``[0, c1, ..., n]`` with every ``c`` in `cuts` minimising the largest partition cost.

    Exact (dynamic programming over the allowed cut points, vectorised over the previous cut); ties go
    to the earliest cut, so every rank given the same costs computes the same bounds."""
    n = len(costs)
    if parts == 1:
        return [0, n]
    points = np.array([0, *sorted(set(cuts)), n])
    if len(points) - 1 < parts:
        raise ValueError(f"the graph can be cut at only {len(points) - 2} places (between nodes whose "
                         f"crossing values are all tensors), too few for {parts} partitions; use "
                         f"partitions <= {len(points) - 1}")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])[points]
    m = len(points)
    # best[j]: least max-cost of splitting points[0]..points[j] into k+1 partitions (k = loop index)
    best = prefix.copy()
    best[0] = np.inf
    choice = np.zeros((parts, m), dtype=np.int64)
    for k in range(1, parts):
        new = np.full(m, np.inf)
        for j in range(k + 1, m):
            cand = np.maximum(best[:j], prefix[j] - prefix[:j])
            cand[:k] = np.inf  # k partitions must fit before the last cut
            i = int(np.argmin(cand))
            new[j], choice[k, j] = cand[i], i
        best = new
    bounds, j = [n], m - 1
    for k in range(parts - 1, 0, -1):
        j = int(choice[k, j])
        bounds.append(int(points[j]))
    return [0, *reversed(bounds)]


def explicit_bounds(sizes: Sequence[int], n: int, cuts: Sequence[int]) -> list[int]:
    """Bounds from a list of node counts per partition (torchgpipe-style ``balance=[...]``)."""
    if any(int(s) < 1 for s in sizes) or sum(sizes) != n:
        raise ValueError(f"balance={list(sizes)} must list a positive node count per partition, summing "
                         f"to the model's {n} graph nodes")
    bounds = [0, *np.cumsum(sizes).tolist()]
    allowed = set(cuts)
    bad = [c for c in bounds[1:-1] if c not in allowed]
    if bad:
        raise ValueError(f"balance={list(sizes)} cuts the graph after node(s) {bad}, where a non-tensor "
                         f"value (e.g. a shape) would cross a boundary; allowed cuts: {sorted(allowed)}")
    return [int(b) for b in bounds]


def bounds_from_balance(balance: str | Sequence[int], parts: int, costs: Sequence[float],
                        cuts: Sequence[int]) -> list[int]:
    """``balance`` is "time"/"params" (then `costs` are the measured seconds/parameter counts) or a list."""
    if isinstance(balance, str):
        return balanced_bounds(costs, cuts, parts)
    return explicit_bounds(list(balance), len(costs), cuts)
