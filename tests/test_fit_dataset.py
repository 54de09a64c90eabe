"""fit on a map-style Dataset and the loop features, against the same training in one process, over
real MPI (2, 3, 4 ranks): the order rule, uneven last batches, per-rank reads, the cross-rank check of
iterables, lr_scheduler / grad_clip / accumulate / bf16 / callbacks, resume on another world size."""

from __future__ import annotations

import re
import tempfile
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from mpitrain.comm.base import split_sizes
from mpitrain.fit import FitError, StopTraining, fit
from tests.helpers import assert_all_ranks, assert_close_all_ranks
from tests.strategies.test_pipesgd import _simulate

pytestmark = pytest.mark.mpi

N, B = 17, 8  # batches of 8, 8, 1: uneven splits, and ranks with no rows in the last batch


class Points(Dataset):
    """N labelled points (float64); records every index it reads."""

    def __init__(self, n: int = N, dtype: torch.dtype = torch.float64) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 6, generator=g, dtype=dtype)
        self.y = (self.x[:, :3] @ torch.randn(3, 3, generator=g, dtype=dtype)).argmax(1)
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads.append(int(i))
        return self.x[i], self.y[i]


def mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def sgd(params):
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


def order_batches(ds: Points, epochs: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
    """The documented order rule, in one process: global batches per epoch."""
    out = []
    for e in range(epochs):
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed + e)) if shuffle \
            else torch.arange(len(ds))
        count = len(ds) // B if drop_last else -(-len(ds) // B)
        out.append([(ds.x[order[i * B:(i + 1) * B]], ds.y[order[i * B:(i + 1) * B]]) for i in range(count)])
    return out


def reference(model, epochs_batches, accumulate=1, clip=None, scheduler=None, precision="fp32", stop_after=None,
              optimizer=sgd):
    """One process: one optimizer step per `accumulate` consecutive global batches on the mean loss of
    their samples; returns (model, per-step losses, per-step lrs)."""
    opt = optimizer(model.parameters())
    sched = scheduler(opt) if scheduler else None
    losses, lrs = [], []
    for batches in epochs_batches:
        for i in range(0, len(batches), accumulate):
            x = torch.cat([b[0] for b in batches[i:i + accumulate]])
            y = torch.cat([b[1] for b in batches[i:i + accumulate]])
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            if sched:
                sched.step()
            losses.append(loss.item())
            if stop_after is not None and len(losses) == stop_after:
                return model, losses, lrs
    return model, losses, lrs


def same_params(comm, a: nn.Module, b: nn.Module, atol: float, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert_close_all_ranks(comm, p.detach(), q.detach(), atol=atol, what=f"{what}: {name}")


@pytest.mark.parametrize("strategy", ["data", "pipe-sgd"])
@pytest.mark.parametrize("shuffle,drop_last", [(True, False), (False, True)])
def test_dataset_training_with_uneven_last_batch_equals_one_process(comm, strategy, shuffle, drop_last):
    ds = Points()
    opts = {"staleness": 1} if strategy == "pipe-sgd" else {"micro_batches": 2}
    result = fit(mlp(), ds, F.cross_entropy, sgd, strategy=strategy, batch_size=B, shuffle=shuffle, seed=3,
                 drop_last=drop_last, epochs=2, progress=False, **opts)
    ref, losses, _ = reference(mlp(), order_batches(ds, 2, shuffle, 3, drop_last))
    same_params(comm, result.model, ref, 1e-10, f"{strategy} shuffle={shuffle} drop_last={drop_last}")
    per_epoch = len(losses) // 2
    for e in range(2):
        sizes = [len(b[1]) for b in order_batches(ds, 2, shuffle, 3, drop_last)[e]]
        mean = sum(lo * s for lo, s in zip(losses[e * per_epoch:(e + 1) * per_epoch], sizes)) / sum(sizes)
        assert_close_all_ranks(comm, torch.tensor(result.history[e]["loss"]), torch.tensor(mean), atol=1e-10,
                               what=f"epoch {e + 1} mean loss")


def test_pipe_sgd_on_a_dataset_equals_algorithm_1_in_one_process(comm):
    ds = Points()
    result = fit(mlp(), ds, F.cross_entropy, sgd, strategy="pipe-sgd", staleness=2, batch_size=B, epochs=2,
                 progress=False)
    batches = [b for epoch in order_batches(ds, 2) for b in epoch]
    ref, _ = _simulate(mlp(), batches, 2, 0, sgd)
    same_params(comm, result.model, ref, 1e-10, "pipe-sgd K=2")


@pytest.mark.parametrize("strategy", ["data", "pipe-sgd"])
def test_each_index_is_read_once_per_epoch_across_ranks(comm, strategy):
    ds = Points(n=23)
    fit(mlp(), ds, F.cross_entropy, sgd, strategy=strategy, batch_size=B, epochs=2, progress=False)
    reads = [i for rank_reads in comm.allgather_object(ds.reads) for i in rank_reads]
    counts = torch.bincount(torch.tensor(reads), minlength=23)
    counts[0] -= comm.size  # before any message every rank reads item 0 once, to check its form
    assert_all_ranks(comm, bool((counts == 2).all()), f"reads per index over 2 epochs: {counts.tolist()}")
    own = 1 + 2 * sum(split_sizes(n, comm.size)[comm.rank] for n in (8, 8, 7))
    assert_all_ranks(comm, len(ds.reads) == own, f"rank {comm.rank} read {len(ds.reads)} samples, its rows are {own}")


def test_iterable_of_global_batches_with_uneven_last_batch_equals_one_process(comm):
    ds = Points()
    epochs = order_batches(ds, 1)
    result = fit(mlp(), epochs[0], F.cross_entropy, sgd, strategy="data", progress=False)
    ref, _, _ = reference(mlp(), epochs)
    same_params(comm, result.model, ref, 1e-10, "iterable with last batch of 1")


def test_ranks_yielding_different_first_batches_raise_fit_error_naming_them(comm):
    g = torch.Generator().manual_seed(comm.rank if comm.rank % 2 else 0)
    data = [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.zeros(8, dtype=torch.long))]
    odd = [r for r in range(comm.size) if r % 2]
    with pytest.raises(FitError, match=re.escape(f"ranks {odd} disagree with rank 0")):
        fit(mlp(), data, F.cross_entropy, sgd, strategy="data", progress=False)
    # a batch larger than the fingerprint's sample, the same rows in another order on odd ranks
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 6, generator=g, dtype=torch.float64)
    order = torch.randperm(4096, generator=torch.Generator().manual_seed(comm.rank % 2))
    with pytest.raises(FitError, match=re.escape(f"ranks {odd} disagree with rank 0")):
        fit(mlp(), [(x[order], torch.zeros(4096, dtype=torch.long))], F.cross_entropy, sgd, strategy="data",
            progress=False)
    # the refused fits closed their kvstores: no comm thread keeps cycling (and recording into later timelines)
    left = [t.name for t in threading.enumerate() if t.name == "kvstore-coordinator"]
    assert_all_ranks(comm, not left, f"comm threads left running: {left}")


@pytest.mark.parametrize("strategy", ["data", "pipe-sgd"])
def test_scheduler_clipping_and_accumulation_equal_one_process(comm, strategy):
    ds = Points(n=29)

    def sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    opts = {"staleness": 1} if strategy == "pipe-sgd" else {}
    result = fit(mlp(), ds, F.cross_entropy, sgd, strategy=strategy, batch_size=B, epochs=2, accumulate=2,
                 grad_clip=0.05, lr_scheduler=sched, progress=False, **opts)
    ref, _, lrs = reference(mlp(), order_batches(ds, 2), accumulate=2, clip=0.05, scheduler=sched)
    same_params(comm, result.model, ref, 1e-10, f"{strategy} scheduler+clip+accumulate")
    assert_all_ranks(comm, [h["lr"] for h in result.history] == [lrs[1], lrs[3]],
                     f"history lr {[h['lr'] for h in result.history]} vs steps' {lrs}")


def test_bf16_autocast_matches_one_process_autocast(comm):
    ds = Points(dtype=torch.float32)
    result = fit(mlp(torch.float32), ds, F.cross_entropy, sgd, strategy="data", batch_size=B, precision="bf16",
                 progress=False)
    ref, losses, _ = reference(mlp(torch.float32), order_batches(ds, 1), precision="bf16")
    full, full_losses, _ = reference(mlp(torch.float32), order_batches(ds, 1))
    same_params(comm, result.model, ref, 2e-2, "bf16")
    assert_all_ranks(comm, losses != full_losses, "autocast made no difference in one process")


def test_callbacks_see_the_history_and_any_rank_can_stop_every_rank(comm):
    ds = Points()
    seen = []

    def on_step(state):
        seen.append((state.epoch, state.step, state.lr))
        return state.step == 3 and comm.rank == comm.size - 1  # one rank's vote stops all

    result = fit(mlp(), ds, F.cross_entropy, sgd, strategy="data", batch_size=B, epochs=3, on_step_end=on_step,
                 progress=False)
    ref, _, _ = reference(mlp(), order_batches(ds, 3), stop_after=3)
    same_params(comm, result.model, ref, 1e-10, "stopped after step 3")
    assert_all_ranks(comm, [s[:2] for s in seen] == [(1, 1), (1, 2), (1, 3)] and len(result.history) == 1,
                     f"steps seen {seen}, history {result.history}")

    def on_epoch(state):
        assert len(state.history) == state.epoch
        raise StopTraining

    result = fit(mlp(), ds, F.cross_entropy, sgd, strategy="pipe-sgd", batch_size=B, epochs=3,
                 on_epoch_end=on_epoch, progress=False)
    assert_all_ranks(comm, len(result.history) == 1, f"history after StopTraining: {result.history}")


@pytest.mark.parametrize("strategy", ["data", "pipe-sgd"])
def test_checkpoint_of_one_process_resumes_on_this_world_size(comm, strategy):
    """Replicated weights reshard trivially: 1 process saves mid-epoch, every rank of this job continues."""
    ds = Points()
    single = comm.split(comm.rank)  # a one-rank communicator per rank
    opts = {"staleness": 2} if strategy == "pipe-sgd" else {}
    with tempfile.TemporaryDirectory() as mine:
        fit(mlp(), ds, F.cross_entropy, sgd, strategy=strategy, batch_size=B, epochs=2, steps=None, comm=single,
            checkpoint_dir=mine, checkpoint_every=2, progress=False,
            on_step_end=lambda s: s.step == 4, **opts)
        shared = comm.broadcast_object(mine)
        result = fit(mlp(), ds, F.cross_entropy, sgd, strategy=strategy, batch_size=B, epochs=2,
                     checkpoint_dir=shared, resume=True, progress=False, **opts)
        comm.barrier()  # rank 0's directory stays until every rank has read it
    single.free()
    batches = [b for epoch in order_batches(ds, 2) for b in epoch]
    if strategy == "pipe-sgd":
        ref, _ = _simulate(mlp(), batches, 2, 0, sgd)
    else:
        ref, _, _ = reference(mlp(), order_batches(ds, 2))
    same_params(comm, result.model, ref, 1e-10, f"{strategy}: 1 process -> {comm.size} ranks")
    assert_all_ranks(comm, len(result.history) == 2, f"history {result.history}")


def test_unsupported_feature_is_refused_on_every_rank_before_any_message(comm):
    with pytest.raises(FitError, match="checkpointing .* is not supported by strategy 'auto' yet"):
        fit(mlp(), Points(), F.cross_entropy, sgd, strategy="auto", batch_size=B, drop_last=True,
            checkpoint_dir="/nonexistent", progress=False)
    with pytest.raises(FitError, match="uneven last batch"):
        fit(mlp(), Points(), F.cross_entropy, sgd, strategy="auto", batch_size=B, progress=False)

