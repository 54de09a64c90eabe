"""fit's training-run features under model and hybrid parallelism, against one process over real MPI
(2, 3, 4 ranks): a Dataset with an uneven last batch, what each rank reads, scheduler / clipping /
accumulation / bf16, and checkpoints (stop and resume bit-identical, load_checkpoint, a meta model;
other layouts resume in tests/strategies/test_zero.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpitrain import checkpoint
from mpitrain.comm.base import split_sizes
from mpitrain.fit import fit
from mpitrain.strategies.pipeline._materialize import materialize
from mpitrain.strategies.pipeline.schedule import placement
from tests.helpers import assert_all_ranks, assert_close_all_ranks, bitwise_equal
from tests.test_fit_dataset import Points, order_batches, reference, sgd

pytestmark = pytest.mark.mpi

N, B = 29, 8  # batches of 8, 8, 8, 5: uneven replica and micro-batch splits (Points(N), as tests/test_fit_dataset's)


class Tied(nn.Module):
    """`shared` is applied near the input and again near the output: with P >= 2 its copies live in
    different partitions (tied parameters, gradients summed, counted once by the clipping norm)."""

    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.inp, self.shared, self.mid, self.head = nn.Linear(6, h), nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.shared(torch.tanh(self.inp(x))))
        x = torch.tanh(self.mid(x))
        x = torch.tanh(self.mid(torch.tanh(self.mid(x))))
        return self.head(torch.tanh(self.shared(x)))


def deep(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(4):
        layers += [nn.Linear(6 if i == 0 else 16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 3)).to(dtype)


def tied(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return Tied().to(dtype)


def layouts(size: int) -> list[tuple[str, int, int]]:
    """(strategy, P, R): the whole pipeline, and replicas (1 x size on odd sizes, 2 x 2 on four)."""
    p = size // 2 if size % 2 == 0 else 1
    return [("model", size, 1), ("hybrid", p, size // p)]


def same_params(comm, got: nn.Module, want: nn.Module, atol: float, what: str) -> None:
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        assert_close_all_ranks(comm, p.detach().double(), q.detach().double(), atol=atol, what=f"{what}: {name}")


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zbv"])
def test_dataset_with_uneven_last_batch_equals_one_process_and_each_rank_reads_only_what_it_uses(comm, schedule):
    for strategy, P, R in layouts(comm.size):
        ds = Points(N)
        # 2P micro-batches: a last batch of 5 rows leaves fewer, not a multiple of P (interleaved's fallback)
        result = fit(deep(), ds, F.cross_entropy, sgd, strategy=strategy, partitions=P, micro_batches=2 * P,
                     schedule=schedule, batch_size=B, epochs=2, balance="params", progress=False)
        batches = order_batches(ds, 2)
        ref, losses, _ = reference(deep(), batches)
        steps = list(zip(losses, [len(y) for epoch in batches for _, y in epoch]))  # (loss, samples) per step
        what = f"{strategy} P={P} R={R} {schedule}"
        same_params(comm, result.model, ref, 1e-10, what)
        for e in range(2):
            part = steps[4 * e:4 * e + 4]
            mean = sum(lo * n for lo, n in part) / sum(n for _, n in part)
            assert_all_ranks(comm, abs(result.history[e]["loss"] - mean) < 1e-10,
                             f"{what}: epoch {e + 1} loss {result.history[e]['loss']} vs {mean}")
        replica, p = divmod(comm.rank, P)
        rows = sum(split_sizes(n, R)[replica] for n in (8, 8, 8, 5))
        where = placement(schedule, P)
        last = next(s for s, row in enumerate(where) if P * len(row) - 1 in row)
        # inputs on the first stage, targets on the last partition's (the last rank; rank 0 under zbv); and
        # item 0 once on every rank before any message, to check its form (fit's Dataset rule)
        assert_all_ranks(comm, ds.reads[:1] == [0], f"{what}: rank {comm.rank} first read {ds.reads[:1]}, not item 0")
        reads = ds.reads[1:]
        want = 2 * rows if p in (0, last) else 0
        assert_all_ranks(comm, len(reads) == want, f"{what}: rank {comm.rank} read {len(reads)}, not {want}")
        firsts = [reads for r, reads in enumerate(comm.allgather_object(reads)) if r % P == 0]
        counts = torch.bincount(torch.tensor([i for reads in firsts for i in reads]), minlength=N)
        assert_all_ranks(comm, bool((counts == 2).all()), f"{what}: first stages' reads per index {counts.tolist()}")


def test_scheduler_clipping_and_accumulation_equal_one_process_with_tied_weights(comm, tmp_path):
    def sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    root = comm.broadcast_object(str(tmp_path))
    for strategy, P, R in layouts(comm.size):
        ds = Points(N)
        result = fit(tied(), ds, F.cross_entropy, sgd, strategy=strategy, partitions=P, micro_batches=2,
                     batch_size=B, epochs=2, accumulate=3, grad_clip=0.05, lr_scheduler=sched, balance="params",
                     checkpoint_dir=f"{root}/{strategy}", progress=False)
        # the tied weight's copies (one per holding rank) consolidate to the trained weight
        consolidated = checkpoint.load_checkpoint(f"{root}/{strategy}")
        assert_all_ranks(comm, bitwise_equal(consolidated, result.model.state_dict()),
                         f"{strategy}: load_checkpoint of a tied model")
        ref, _, lrs = reference(tied(), order_batches(ds, 2), accumulate=3, clip=0.05, scheduler=sched)
        same_params(comm, result.model, ref, 1e-10, f"{strategy} P={P} R={R} scheduler+clip+accumulate")
        assert_all_ranks(comm, [h["lr"] for h in result.history] == [lrs[1], lrs[3]],
                         f"history lr {[h['lr'] for h in result.history]} vs steps' {lrs}")


def test_bf16_autocast_matches_one_process_autocast(comm):
    for strategy, P, R in layouts(comm.size):
        ds = Points(dtype=torch.float32)
        held_out = [(ds.x[:7], ds.y[:7])]
        result = fit(deep(torch.float32), ds, F.cross_entropy, sgd, strategy=strategy, partitions=P,
                     micro_batches=2, batch_size=B, precision="bf16", balance="params", eval_data=held_out,
                     progress=False)
        ref, losses, _ = reference(deep(torch.float32), order_batches(ds, 1), precision="bf16")
        _, full, _ = reference(deep(torch.float32), order_batches(ds, 1))
        same_params(comm, result.model, ref, 2e-2, f"{strategy} P={P} R={R} bf16")
        assert_all_ranks(comm, losses != full, "autocast made no difference in one process")
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            want = F.cross_entropy(ref(held_out[0][0]).float(), held_out[0][1]).item()
        got = result.history[-1]["eval_loss"]
        assert_all_ranks(comm, abs(got - want) < 2e-2, f"{strategy} bf16 eval loss {got} vs {want}")


def noisy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 16),
                         nn.Tanh(), nn.Linear(16, 3)).double()


def test_stopped_run_resumes_bit_identical_and_load_checkpoint_consolidates(comm, tmp_path):
    root = comm.broadcast_object(str(tmp_path))  # rank 0's directory: every rank sees it

    def train(strategy, P, directory, **kw):
        torch.manual_seed(100 + comm.rank)  # dropout streams differ per rank
        return fit(noisy(), Points(45), F.cross_entropy, sgd, strategy=strategy, partitions=P,
                   micro_batches=2 if strategy == "model" else 1, batch_size=12, epochs=2, balance="params",
                   checkpoint_dir=directory, checkpoint_every=3, grad_clip=1.0, progress=False,
                   lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5), **kw)

    for strategy, P, R in layouts(comm.size):
        full_dir, part_dir = f"{root}/{strategy}-full", f"{root}/{strategy}-part"
        full = train(strategy, P, full_dir)
        stopped = train(strategy, P, part_dir, on_step_end=lambda s: s.step == 5)
        resumed = train(strategy, P, part_dir, resume=True)
        what = f"{strategy} P={P} R={R}"
        shards = [checkpoint.read_shard(checkpoint.latest(d), comm.rank)["trainer"] for d in (full_dir, part_dir)]
        ok = bitwise_equal(resumed.model.state_dict(), full.model.state_dict()) and bitwise_equal(shards[0], shards[1])
        ok = ok and [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
        assert_all_ranks(comm, ok and len(stopped.history) == 2, f"{what}: resumed run differs from the uninterrupted")
        consolidated = checkpoint.load_checkpoint(part_dir)
        fresh = noisy()
        fresh.load_state_dict(consolidated)  # the user's class takes it as is
        assert_all_ranks(comm, bitwise_equal(consolidated, full.model.state_dict()), f"{what}: load_checkpoint")
        held = [k for k, t in shards[0]["model"].items()]
        assert_all_ranks(comm, R > 1 or len(held) < len(consolidated) or comm.size == 1,
                         f"{what}: rank {comm.rank} saved the whole model {held}")


def test_checkpoint_of_fewer_replicas_resumes_on_more(comm, tmp_path):
    """Replicas hold the same weights: P ranks (one replica) save mid-run, every rank continues."""
    _, P, R = layouts(comm.size)[1]
    directory = comm.broadcast_object(str(tmp_path / "ckpt"))
    first = comm.split(0 if comm.rank < P else None, comm.rank)
    if first is not None:
        fit(deep(), Points(N), F.cross_entropy, sgd, strategy="hybrid", partitions=P, micro_batches=2, batch_size=B,
            epochs=2, balance="params", checkpoint_dir=directory, checkpoint_every=3, comm=first, progress=False,
            on_step_end=lambda s: s.step == 5)
        first.free()
    result = fit(deep(), Points(N), F.cross_entropy, sgd, strategy="hybrid", partitions=P, micro_batches=2,
                 batch_size=B, epochs=2, checkpoint_dir=directory, resume=True, progress=False)
    ref, _, _ = reference(deep(), order_batches(Points(N), 2))
    same_params(comm, result.model, ref, 1e-10, f"hybrid P={P}: 1 replica -> {R}")
    assert_all_ranks(comm, len(result.history) == 2, f"history {result.history}")


def test_meta_model_checkpoints_its_materialised_partition_and_resumes(comm, tmp_path):
    root = comm.broadcast_object(str(tmp_path))

    def on_meta() -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
                                 nn.Tanh(), nn.Linear(16, 3)).double()

    def train(directory, **kw):
        return fit(on_meta(), Points(N), F.cross_entropy, sgd, strategy="model", partitions=comm.size, batch_size=B,
                   epochs=2, balance="params", checkpoint_dir=directory, progress=False, **kw)

    train(f"{root}/full")
    train(f"{root}/part", checkpoint_every=2, on_step_end=lambda s: s.step == 3)
    train(f"{root}/part", resume=True)
    reference_model = on_meta()
    materialize(reference_model)  # one process, the same seeded initialisation
    ref, _, _ = reference(reference_model, order_batches(Points(N), 2))
    full, part = checkpoint.load_checkpoint(f"{root}/full"), checkpoint.load_checkpoint(f"{root}/part")
    assert_all_ranks(comm, bitwise_equal(full, part), "resumed meta run differs from the uninterrupted one")
    assert_all_ranks(comm, list(full) == list(ref.state_dict()), f"consolidated keys {list(full)}")
    for k, t in ref.state_dict().items():
        assert_close_all_ranks(comm, full[k], t, atol=1e-10, what=f"consolidated {k}")
