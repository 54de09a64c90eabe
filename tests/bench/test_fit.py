"""`mpitrain bench fit` runs its two contenders and reports fit against plain torch (this checks the
table on a tiny model, not speed: the numbers are in docs/gpu.md)."""

from __future__ import annotations

import torch
from torch import nn

import mpitrain
from mpitrain.bench import fit as bench_fit


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 2))


def test_fit_table_times_fit_against_the_hand_written_loop(monkeypatch):
    monkeypatch.setitem(bench_fit.MODELS, "tiny", (_tiny, 4, 2, 2, 2))
    comm = mpitrain.init()
    for clock in ("wall", "cpu"):
        args = bench_fit._parse(["--model", "tiny", "--epochs", "2", "--steps-per-epoch", "2", "--rounds", "1",
                                 "--clock", clock])
        rows = bench_fit.measure(comm, args, torch.device("cpu"), "fp32")
        assert [r[1] for r in rows] == ["plain torch", "fit"]
        assert all(r[2] > 0 for r in rows) and rows[0][5] == 1.0 and rows[1][5] > 0
