"""A data-parallel checkpoint holds the replicated weights once: at N ranks every whole parameter (and at
zero=0 its optimizer state) is in exactly one rank's shard, the shards' bytes on disk add up to ~1x the
weights (+ per-rank buffers, RNG and optimizer pieces), not N x; a run resumed from it at the same
world size ends bit-identical to the uninterrupted run on every rank, and so does one resumed from a
checkpoint of the older layout (every rank wrote everything). Other world sizes and ZeRO stages:
tests/strategies/test_zero.py (test_checkpoints_resume_at_another_world_size_...)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from mpitrain import checkpoint
from mpitrain.fit import fit
from mpitrain.strategies import assemble
from tests.helpers import assert_all_ranks, bitwise_equal

pytestmark = pytest.mark.mpi

SMALL = 32 << 10  # a rank's bytes besides the weights: RNG states (~10 KiB), buffers, file overhead


def model() -> nn.Module:
    torch.manual_seed(0)  # weights of very different sizes: the split balances bytes, not counts
    return nn.Sequential(nn.Linear(6, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 128),
                         nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 3))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(48, 6, generator=g)
    return TensorDataset(x, (x[:, :3] @ torch.randn(3, 3, generator=g)).argmax(1))


def train(comm, directory: str, zero: int, **kw):
    torch.manual_seed(100 + comm.rank)  # dropout streams differ per rank
    return fit(model(), data(), F.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
               strategy="data", zero=zero, batch_size=12, epochs=2, checkpoint_dir=directory, checkpoint_every=3,
               grad_clip=1.0, progress=False, comm=comm, **kw)


def to_old_layout(src: Path, dst: Path, zero: int, comm) -> None:
    """Copy checkpoint `src` to `dst` as the older layout wrote it: every rank's shard holds every whole
    tensor (its own buffers) and at zero=0 every parameter's optimizer state (with zero its own pieces)."""
    if comm.rank == 0:
        shutil.copytree(src, dst)
    comm.allgather_object(None)  # the copy exists before any rank rewrites its shard
    shards = [checkpoint.read_shard(src, r)["trainer"] for r in range(comm.size)]
    pieces = {n for s in shards for n in s["model_pieces"]}
    mine = checkpoint.read_shard(src, comm.rank)
    trainer = mine["trainer"]
    trainer["model"] = {**{k: v for k, v in assemble(shards).items() if k not in pieces}, **trainer["model"]}
    if zero == 0:
        trainer["optim"]["state"] = {k: v for s in shards for k, v in s["optim"]["state"].items()}
    torch.save(mine, dst / checkpoint.shard_name(comm.rank))
    comm.allgather_object(None)


def last_step(directory: Path) -> str:
    found = checkpoint.latest(directory)
    assert found is not None
    return found.name


def resumes_like_the_full_run(comm, resume: Callable[[str], Any], root: Path, full: Any, params: Any,
                              label: str) -> dict[str, torch.Tensor]:
    """``resume(directory)`` from ``root/part`` (the split checkpoint) and from ``root/old`` (the older layout)
    ends bit-identical to the uninterrupted run `full` (weights, buffers, losses, the final shard: optimizer
    state, in-flight gradients, RNG), and ``load_checkpoint(root/full)`` equals its model (rank 0's buffers;
    `params` on every rank). Returns the consolidated state dict."""
    last = last_step(root / "full")
    for directory in ("part", "old"):
        resumed = resume(str(root / directory))
        what = f"{label}, resumed from the {'older layout' if directory == 'old' else 'split checkpoint'}"
        assert_all_ranks(comm, bitwise_equal(resumed.model.state_dict(), full.model.state_dict()),
                         f"{what}: this rank's weights or buffers differ from the uninterrupted run")
        assert_all_ranks(comm, [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history],
                         f"{what}: losses differ")
        assert_all_ranks(comm, bitwise_equal(checkpoint.read_shard(root / directory / last, comm.rank),
                                             checkpoint.read_shard(root / "full" / last, comm.rank)),
                         f"{what}: the final checkpoint's shard (optimizer state, in-flight gradients, RNG) differs")
    consolidated, want = checkpoint.load_checkpoint(root / "full"), full.model.state_dict()
    ok = list(consolidated) == list(want) and all(torch.equal(consolidated[k], v) for k, v in want.items()
                                                  if comm.rank == 0 or k in params)
    assert_all_ranks(comm, ok, f"{label}: load_checkpoint differs from the trained model (rank 0's buffers)")
    return consolidated


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_checkpoint_holds_the_weights_once_and_resumes_bit_identical(comm, tmp_path, zero):
    root = Path(comm.broadcast_object(str(tmp_path)))
    full = train(comm, str(root / "full"), zero)
    stopped = train(comm, str(root / "part"), zero, on_step_end=lambda s: s.step == 5)
    assert_all_ranks(comm, len(stopped.history) == 2, "the run did not stop in epoch 2")
    to_old_layout(root / "part" / "step-5", root / "old" / "step-5", zero, comm)

    # the weights and the momentum (split at zero=0, ZeRO pieces otherwise) are on disk once in total
    params = dict(model().named_parameters())
    weights = sum(p.numel() * p.element_size() for p in params.values())
    largest = max(p.numel() * p.element_size() for p in params.values())
    step3 = root / "full" / "step-3"
    sizes = [(step3 / checkpoint.shard_name(r)).stat().st_size for r in range(comm.size)]
    assert_all_ranks(comm, sum(sizes) <= 2 * weights + comm.size * SMALL,
                     f"shards of {sizes} bytes at {comm.size} ranks: weights + momentum are {2 * weights}")
    assert_all_ranks(comm, max(sizes) <= 2 * weights / comm.size + 2 * largest + SMALL,
                     f"shards of {sizes} bytes: one writes more than its share of {2 * weights} + one tensor")
    held = [n for r in range(comm.size) for n in checkpoint.read_shard(step3, r)["trainer"]["model"] if n in params]
    assert_all_ranks(comm, zero == 3 or sorted(held) == sorted(params),
                     f"parameters written {sorted(held)}: each must be in exactly one shard")

    resumes_like_the_full_run(comm, lambda d: train(comm, d, zero, resume=True), root, full, params, f"zero={zero}")


# -- pipe-sgd, spatial, hybrid: the replicated weights once too -------------------------------------------------

def mlp() -> nn.Module:
    torch.manual_seed(0)  # float64, weights of very different sizes
    return nn.Sequential(nn.Linear(6, 96), nn.BatchNorm1d(96), nn.ReLU(), nn.Dropout(0.2), nn.Linear(96, 96),
                         nn.ReLU(), nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 96), nn.ReLU(),
                         nn.Linear(96, 3)).double()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 24, 3, 1, 1), nn.BatchNorm2d(24), nn.ReLU(), nn.Dropout(0.2),
                         nn.Conv2d(24, 32, 3, 1, 1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 16, 3, 1, 1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3)).double()


def images() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 2, 12, 12, generator=g, dtype=torch.float64)
    return TensorDataset(x, (x.mean((2, 3)) @ torch.randn(2, 3, generator=g, dtype=torch.float64)).argmax(1))


def case(name: str, size: int) -> tuple:
    """(model factory, data, fit arguments, bytes per weight byte on disk in total: weights, momentum and,
    for pipe-sgd at staleness 2, the two averaged gradients in flight at a save: of the step just taken and
    of the one before, applied at the next step)."""
    if name == "pipe-sgd":
        return mlp, data().tensors, {"strategy": "pipe-sgd", "staleness": 2, "batch_size": 12}, 4
    if name == "spatial":
        return cnn, images().tensors, {"strategy": "spatial", "grid": (size, 1), "batch_size": 6}, 2
    p = size // 2 if size % 2 == 0 else 1  # 1 x 2, 1 x 3, 2 x 2
    return mlp, data().tensors, {"strategy": "hybrid", "partitions": p, "replicas": size // p, "batch_size": 12,
                                 "balance": "params"}, 2


def run(comm, name: str, directory: str, **kw):
    factory, (x, y), args, _ = case(name, comm.size)
    torch.manual_seed(100 + comm.rank)  # dropout streams differ per rank
    return fit(factory(), TensorDataset(x.to(torch.float64), y), F.cross_entropy,
               lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), epochs=2, checkpoint_dir=directory,
               checkpoint_every=3, grad_clip=1.0, progress=False, comm=comm, **args, **kw)


def write_as_main(monkeypatch, name: str) -> None:
    """Make the trainer of `name` write checkpoints as main did before the split: pipe-sgd and spatial
    every rank its whole replica in torch's formats (main's state_dict, verbatim), hybrid every replica
    its whole partitions."""
    from mpitrain.spatial.trainer import SpatialTrainer
    from mpitrain.strategies import NAMED
    from mpitrain.strategies.pipeline._trainer import PipelineTrainer
    from mpitrain.strategies.pipesgd import PipeSGDTrainer

    def pipesgd_state(self):
        pending = [(h.iteration, self.comm_thread.wait(h)) for h in self._pending]
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "t": self.t,
                "pending": pending, "residual": self.comm_thread.residual}

    def spatial_state(self):
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    if name == "hybrid":
        monkeypatch.setattr(PipelineTrainer, "_written_elsewhere", lambda self, tensors: set())
        return
    cls, state = (PipeSGDTrainer, pipesgd_state) if name == "pipe-sgd" else (SpatialTrainer, spatial_state)
    layout = cls.layout
    monkeypatch.setattr(cls, "layout", lambda self: {k: v for k, v in layout(self).items() if k != NAMED})
    monkeypatch.setattr(cls, "state_dict", state)


def written(shards: list[dict]) -> list[str]:
    """Every parameter name and in-flight gradient name the shards hold, once per shard holding it."""
    return [*(n for s in shards for n in s["model"]),
            *(f"pending/{j}/{n}" for s in shards for j, e in enumerate(s.get("pending", [])) for n in e["grads"])]


@pytest.mark.parametrize("name", ["pipe-sgd", "spatial", "hybrid"])
def test_replicated_strategies_write_the_weights_once_and_resume_bit_identical(comm, tmp_path, monkeypatch, name):
    root = Path(comm.broadcast_object(str(tmp_path)))
    factory, _, args, per_weight = case(name, comm.size)
    full = run(comm, name, str(root / "full"))
    stopped = run(comm, name, str(root / "part"), on_step_end=lambda s: s.step == 5)
    with monkeypatch.context() as m:
        write_as_main(m, name)
        run(comm, name, str(root / "old"), on_step_end=lambda s: s.step == 5)
    assert_all_ranks(comm, len(stopped.history) == 2, "the run did not stop in epoch 2")
    old = [checkpoint.read_shard(root / "old" / "step-5", r)["trainer"] for r in range(comm.size)]
    assert_all_ranks(comm, "optimizer" in old[0] or name == "hybrid", "the old layout was not written")

    params = dict(factory().named_parameters())
    weights = sum(p.numel() * p.element_size() for p in params.values())
    largest = max(p.numel() * p.element_size() for p in params.values())
    step3 = root / "full" / "step-3"
    sizes = [(step3 / checkpoint.shard_name(r)).stat().st_size for r in range(comm.size)]
    total = per_weight * weights
    assert_all_ranks(comm, sum(sizes) <= total + comm.size * SMALL,
                     f"{name}: shards of {sizes} bytes at {comm.size} ranks, the replicated state is {total}")
    assert_all_ranks(comm, max(sizes) <= total / comm.size + 2 * per_weight * largest + SMALL,
                     f"{name}: shards of {sizes} bytes: one writes more than its share of {total} + one tensor")
    shards = [checkpoint.read_shard(step3, r)["trainer"] for r in range(comm.size)]
    held = [n for n in written(shards) if n.split("/")[-1] in params]
    want = [*params, *(f"pending/{j}/{n}" for j in range(2) for n in params if name == "pipe-sgd")]
    assert_all_ranks(comm, sorted(held) == sorted(want), f"{name}: written {sorted(held)}: each once, of {want}")
    state = [n for s in shards for n in s["optim"]["state"]]
    assert_all_ranks(comm, sorted(state) == sorted(params), f"{name}: optimizer state of {sorted(state)}")

    consolidated = resumes_like_the_full_run(comm, lambda d: run(comm, name, d, resume=True), root, full, params,
                                             name)
    factory().load_state_dict(consolidated)  # the user's class takes it as is
