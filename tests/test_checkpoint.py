"""Checkpoints in one process: the layout and atomicity of `save`, RNG states, exact resume,
`load_checkpoint` without MPI, and the refusals (a directory of another run, another data order)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import mpitrain
from mpitrain import checkpoint
from mpitrain.fit import FitError, fit


def data(n: int = 22) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, (x[:, :2].sum(1) > 0).long())


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 2))


def train(directory: Path | None, **kw) -> mpitrain.FitResult:
    torch.manual_seed(3)
    return fit(model(), data(), F.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
               strategy=kw.pop("strategy", "data"), batch_size=kw.pop("batch_size", 4), epochs=2,
               checkpoint_dir=directory, progress=False, **kw)


def test_rng_states_round_trip_through_a_weights_only_load(tmp_path):
    state = checkpoint.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (torch.rand(3), random.random(), np.random.rand())
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (torch.rand(3), random.random(), np.random.rand())[1:] == expected[1:]
    checkpoint.set_rng_state(state)
    assert torch.equal(torch.rand(3), expected[0])


def test_a_failure_mid_save_leaves_no_visible_checkpoint_and_the_next_save_cleans_up(tmp_path, monkeypatch):
    comm = mpitrain.init()

    def boom(path: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "_after_write", boom)
    with pytest.raises(checkpoint.CheckpointError, match="disk full"):
        checkpoint.save(comm, tmp_path, 5, {"trainer": {"model": {}}}, {})
    assert checkpoint.latest(tmp_path) is None and (tmp_path / ".step-5.tmp").is_dir()
    monkeypatch.setattr(checkpoint, "_after_write", None)
    path = checkpoint.save(comm, tmp_path, 5, {"trainer": {"model": {"w": torch.ones(2)}}}, {})
    assert checkpoint.latest(tmp_path) == path == tmp_path / "step-5"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5"]
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "rank-0.pt"]


@pytest.mark.parametrize("strategy", ["data", "pipe-sgd", "model"])
def test_stopped_run_resumes_bit_identical_and_load_checkpoint_consolidates(tmp_path, strategy):
    full = train(tmp_path / "full", checkpoint_every=3, strategy=strategy)
    stopped = train(tmp_path / "part", checkpoint_every=3, strategy=strategy, on_step_end=lambda s: s.step == 7)
    assert sorted(p.name for p in (tmp_path / "part").iterdir()) == ["step-3", "step-6", "step-7"]
    assert len(stopped.history) == 2  # epoch 1 and the partial epoch 2
    resumed = train(tmp_path / "part", checkpoint_every=3, strategy=strategy, resume=True)
    for a, b in ((resumed.model.state_dict(), full.model.state_dict()),
                 (checkpoint.load_checkpoint(tmp_path / "part"), full.model.state_dict())):
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    assert [h["lr"] for h in resumed.history] == [0.1, 0.1]
    consolidated = checkpoint.load_checkpoint(tmp_path / "full" / "step-3")
    fresh = model()
    fresh.load_state_dict(consolidated)  # the user's class takes it as is


def test_a_directory_of_another_run_or_another_data_order_is_refused(tmp_path):
    train(tmp_path, checkpoint_every=100, steps=2)
    with pytest.raises(FitError, match="already holds checkpoints"):
        train(tmp_path)
    with pytest.raises(FitError, match="'batch_size': 4.*'batch_size': 5"):
        train(tmp_path, resume=True, batch_size=5)
    with pytest.raises(FitError, match="written by strategy .data."):
        train(tmp_path, resume=True, strategy="pipe-sgd")


def test_resume_without_checkpoints_starts_fresh(tmp_path):
    a = train(tmp_path / "new", resume=True)
    b = train(None)
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))


@pytest.mark.parametrize("strategy", ["auto"])
def test_strategies_without_checkpoint_hooks_refuse_clearly_before_any_message(tmp_path, strategy):
    with pytest.raises(FitError, match=f"checkpointing .* is not supported by strategy '{strategy}' yet"):
        train(tmp_path, strategy=strategy)
    with pytest.raises(FitError, match=f"grad_clip= is not supported by strategy '{strategy}' yet"):
        train(None, strategy=strategy, grad_clip=1.0, drop_last=True)


def test_split_by_bytes_gives_every_part_at_most_its_share_plus_one_item():
    from mpitrain.strategies._reshard import split_by_bytes

    g = random.Random(5)
    for parts in (1, 2, 3, 4, 7):
        sizes = [g.choice([4, 400, 40_000, 4_000_000]) * g.randint(1, 9) for _ in range(g.randint(0, 60))]
        owner = split_by_bytes(sizes, parts)
        assert owner == split_by_bytes(list(sizes), parts)  # the same assignment on every rank
        loads = [sum(s for s, o in zip(sizes, owner) if o == p) for p in range(parts)]
        assert all(0 <= o < parts for o in owner) and sum(loads) == sum(sizes)
        assert max(loads) <= sum(sizes) / parts + max(sizes, default=0), (parts, loads)
    assert split_by_bytes([10, 10, 10, 10], 2) == [0, 1, 0, 1] and split_by_bytes([1, 8, 1], 2) == [1, 0, 1]
