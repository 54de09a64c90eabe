"""fit's step losses over real MPI (2, 3, 4 ranks): without ``on_step_end`` they are summed over the
ranks once per epoch (one message, whatever the epoch's steps), with it once per step; the history is
the same float either way, with any number of steps held between reads, and equals one process's."""

from __future__ import annotations

import os
import sys
from collections import Counter
from types import FrameType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpitrain.comm import tracing
from mpitrain.fit import _PendingLosses, fit
from tests.helpers import assert_all_ranks, assert_close_all_ranks

pytestmark = pytest.mark.mpi

COMM_DIR = os.path.join("mpitrain", "comm", "")


class LossMessages:
    """A tracer (comm/tracing.py) counting, by call name, the messages the step-loss code sends: those
    whose first caller outside mpitrain/comm is StepTrainer.train_shares or StepTrainer.step_losses
    (the gradient's messages start in DataParallel or its store)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def add(self, kind: str, name: str, t0: int, t1: int, args: dict[str, Any] | None = None) -> None:
        f: FrameType | None = sys._getframe(1)
        while f is not None and COMM_DIR in f.f_code.co_filename:
            f = f.f_back
        if f is not None and f.f_code.co_name in ("train_shares", "step_losses"):
            self.calls[name] += 1

    def add_wait(self, name: str, t0: int, t1: int, args: dict[str, Any] | None = None, clip: bool = True) -> None:
        pass


def batches(steps: int, rows: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)  # the same global batches on every rank
    return [(torch.randn(rows, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (rows,), generator=g))
            for _ in range(steps)]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def train(comm, steps: int, epochs: int = 2, **kw: Any) -> tuple[list[float], Counter[str]]:
    """fit (strategy "data") over `steps` global batches per epoch: the history's losses and the loss
    messages sent."""
    tracer = LossMessages()
    previous = tracing.set_tracer(tracer)
    try:
        result = fit(model(), batches(steps), F.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9),
                     epochs=epochs, progress=False, comm=comm, **kw)
    finally:
        tracing.set_tracer(previous)
    return [h["loss"] for h in result.history], tracer.calls


@pytest.mark.parametrize("steps", [3, 6])
def test_without_on_step_end_the_losses_go_in_one_message_per_epoch(comm, steps):
    _, calls = train(comm, steps, epochs=2)
    assert_all_ranks(comm, calls == Counter({"allgather": 2}), f"{steps} steps x 2 epochs sent {dict(calls)}")
    _, calls = train(comm, steps, epochs=2, on_step_end=lambda state: None)
    assert_all_ranks(comm, calls == Counter({"allgather": 2 * steps}),
                     f"with on_step_end, {steps} steps x 2 epochs sent {dict(calls)}")


def test_the_history_is_the_same_float_however_the_losses_are_read(comm, monkeypatch):
    per_step, _ = train(comm, 5, epochs=2, on_step_end=lambda state: None)
    per_epoch, _ = train(comm, 5, epochs=2)
    monkeypatch.setattr(_PendingLosses, "CAPACITY", 2)  # read after steps 2, 4 and at the end
    in_pairs, calls = train(comm, 5, epochs=2)
    assert_all_ranks(comm, per_step == per_epoch == in_pairs and calls == Counter({"allgather": 6}),
                     f"per step {per_step}, per epoch {per_epoch}, every 2 steps {in_pairs} ({dict(calls)})")
    # one process: each step's mean loss over its global batch, the epoch's mean weighted by samples
    ref, data, expected = model(), batches(5), []
    opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    for _ in range(2):
        total = 0.0
        for x, y in data:
            opt.zero_grad()
            loss = F.cross_entropy(ref(x), y)
            loss.backward()
            opt.step()
            total += loss.item() * len(y)
        expected.append(total / sum(len(y) for _, y in data))
    assert_close_all_ranks(comm, torch.tensor(per_epoch), torch.tensor(expected), atol=1e-12)
