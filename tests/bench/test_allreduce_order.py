"""`mpitrain bench allreduce` rotates its contenders' order each round (serial)."""

from __future__ import annotations

from mpitrain.bench.allreduce import _round_order


def test_over_as_many_rounds_as_contenders_each_runs_once_in_every_position():
    names = ["ompi", "ring", "mpitrain", "gloo"]
    orders = [_round_order(names, r) for r in range(len(names))]
    assert all(sorted(o) == sorted(names) for o in orders)
    for pos in range(len(names)):
        assert sorted(o[pos] for o in orders) == sorted(names)
    assert _round_order(names, len(names)) == names
