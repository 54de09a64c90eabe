"""`fit(strategy="spatial")` training runs over real MPI (2, 3, 4 ranks), against one process: a map-style
Dataset with an uneven last batch (a batch smaller than the sample groups too), each rank's reads (its
group's rows; only its block with region reads), lr_scheduler / grad_clip / accumulate, bf16 autocast,
and checkpoints: a stopped run resumes bit-identical, `load_checkpoint` consolidates, another layout
resumes from rank 0's replica."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from mpitrain import checkpoint
from mpitrain.comm.base import split_sizes
from mpitrain.fit import fit
from mpitrain.spatial import RegionSamples
from tests.helpers import assert_all_ranks, assert_close_all_ranks, bitwise_equal
from tests.spatial.test_trainer import hybrid_layouts

pytestmark = pytest.mark.mpi

N, B, H, W = 9, 4, 12, 10  # global batches 4, 4, 1: uneven splits, and groups without a sample


def images(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, 2, H, W, generator=g, dtype=dtype)
    return x, (x[:, 0].mean((1, 2)) > x[:, 1].mean((1, 2))).long() + (x[:, 0, 0, 0] > 0).long()


class Images(Dataset):
    """Whole images (a plain Dataset: read whole and cropped); records every index read."""

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        self.x, self.y = images(dtype)
        self.reads: list[tuple[int, tuple[int, int], tuple[int, int]]] = []

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads.append((int(i), (0, H), (0, W)))
        return self.x[i], self.y[i]


class ImageRegions:
    """A RegionDataset in memory; records every (index, rows, cols) read."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x, self.reads = x, []

    def __len__(self) -> int:
        return len(self.x)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def read(self, index: int, region: tuple[slice, slice]) -> torch.Tensor:
        self.reads.append((int(index), (region[0].start, region[0].stop), (region[1].start, region[1].stop)))
        return self.x[index, :, region[0], region[1]].clone()


def dataset(kind: str, dtype: torch.dtype = torch.float64) -> Dataset:
    if kind == "plain":
        return Images(dtype)
    x, y = images(dtype)
    return RegionSamples(ImageRegions(x), y)


def cnn(dtype: torch.dtype = torch.float64, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, 1, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(dropout), nn.MaxPool2d(2),
                         nn.Conv2d(4, 4, 3, 1, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3)).to(dtype)


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def epoch_batches(epochs: int) -> list[list[torch.Tensor]]:
    """The documented order rule (shuffle, seed 0): each epoch's global batches of indices."""
    return [list(torch.randperm(N, generator=torch.Generator().manual_seed(e)).split(B)) for e in range(epochs)]


def reference(model: nn.Module, epochs: int, accumulate: int = 1, clip: float | None = None, scheduler=None,
              precision: str = "fp32", dtype: torch.dtype = torch.float64) -> tuple[nn.Module, list[float]]:
    """One process: per optimizer step, one forward per global batch (BatchNorm per batch, as in fit),
    each batch's mean loss weighted by its share of the step's samples; returns the per-epoch losses."""
    x, y = images(dtype)
    opt = sgd(model.parameters())
    sched = scheduler(opt) if scheduler else None
    history = []
    for batches in epoch_batches(epochs):
        total_loss = 0.0
        for i in range(0, len(batches), accumulate):
            group = batches[i:i + accumulate]
            total = sum(len(b) for b in group)
            opt.zero_grad()
            for b in group:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = F.cross_entropy(model(x[b]), y[b])
                (loss * (len(b) / total)).backward()
                total_loss += loss.item() * len(b)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            if sched is not None:
                sched.step()
        history.append(total_loss / N)
    return model, history


def expected_reads(comm, samples: int, grid: tuple[int, int], epochs: int, regions: bool) -> list[tuple]:
    """What this rank must read: its group's rows of every global batch; its block (regions) or the whole."""
    group, spatial = divmod(comm.rank, grid[0] * grid[1])
    row, col = divmod(spatial, grid[1])
    rows = [(a, a + s) for a, s in zip([0, *torch.tensor(split_sizes(H, grid[0])).cumsum(0).tolist()],
                                       split_sizes(H, grid[0]))][row]
    cols = [(a, a + s) for a, s in zip([0, *torch.tensor(split_sizes(W, grid[1])).cumsum(0).tolist()],
                                       split_sizes(W, grid[1]))][col]
    out = []
    for batches in epoch_batches(epochs):
        for b in batches:
            start = sum(split_sizes(len(b), samples)[:group])
            for i in b[start:start + split_sizes(len(b), samples)[group]].tolist():
                out.append((i, rows, cols) if regions else (i, (0, H), (0, W)))
    return out


def same_state(comm, actual: dict, expected: dict, tol: float, what: str) -> None:
    assert_all_ranks(comm, list(actual) == list(expected), f"{what}: keys {list(actual)} vs {list(expected)}")
    for name in expected:
        assert_close_all_ranks(comm, actual[name].double(), expected[name].double(), tol, tol, f"{what}: {name}")


@pytest.mark.parametrize("kind", ["plain", "regions"])
@pytest.mark.parametrize("which", [0, 1], ids=["spatial", "hybrid"])
def test_dataset_with_uneven_batches_equals_one_process_and_each_rank_reads_only_its_share(comm, which, kind):
    grid, samples = hybrid_layouts(comm.size)[which]
    data = dataset(kind)
    result = fit(cnn(), data, F.cross_entropy, sgd, strategy="spatial", grid=grid, samples=samples, batch_size=B,
                 epochs=2, progress=False, eval_data=Images())
    ref, history = reference(cnn(), 2)
    x, y = images()
    with torch.no_grad():
        eval_loss = sum(F.cross_entropy(ref.eval()(x[a:a + B]), y[a:a + B]).item() * len(y[a:a + B])
                        for a in range(0, N, B)) / N
    assert_all_ranks(comm, abs(result.history[-1]["eval_loss"] - eval_loss) < 1e-10,
                     f"eval loss {result.history[-1]['eval_loss']} vs {eval_loss} (last eval batch of 1)")
    same_state(comm, result.model.state_dict(), ref.state_dict(), 1e-10, f"grid {grid} x {samples}, {kind}")
    assert_all_ranks(comm, all(abs(h["loss"] - e) < 1e-10 for h, e in zip(result.history, history)),
                     f"losses {[h['loss'] for h in result.history]} vs {history}")
    reads = data.reads if kind == "plain" else data.regions.reads  # type: ignore[attr-defined]
    expected = expected_reads(comm, samples, grid, 2, kind == "regions")
    if kind == "plain":  # before any message every rank reads item 0 once, to check its form (not region reads)
        expected = [(0, (0, H), (0, W)), *expected]
    assert_all_ranks(comm, reads == expected, f"read {reads}, expected {expected}")


@pytest.mark.parametrize("which", [0, 1], ids=["spatial", "hybrid"])
def test_sync_batchnorm_trains_as_batchnorm_over_the_global_batch_like_one_process(comm, which):
    """A DDP user's model (``convert_sync_batchnorm``): its SyncBatchNorm layers take global statistics, as the
    grid's BatchNorm does, so the run equals one process with plain BatchNorm (it was refused)."""
    grid, samples = hybrid_layouts(comm.size)[which]
    model = nn.SyncBatchNorm.convert_sync_batchnorm(cnn())
    result = fit(model, dataset("plain"), F.cross_entropy, sgd, strategy="spatial", grid=grid, samples=samples,
                 batch_size=B, epochs=1, progress=False)
    ref, _ = reference(cnn(), 1)
    assert_all_ranks(comm, isinstance(result.model[1], nn.SyncBatchNorm), "the user's module came back")
    same_state(comm, result.model.state_dict(), ref.state_dict(), 1e-10, f"grid {grid} x {samples}")


@pytest.mark.parametrize("which", [0, 1], ids=["spatial", "hybrid"])
def test_clip_scheduler_and_accumulate_equal_one_process(comm, which):
    grid, samples = hybrid_layouts(comm.size)[which]
    result = fit(cnn(), dataset("plain"), F.cross_entropy, sgd, strategy="spatial", grid=grid, samples=samples,
                 batch_size=B, epochs=2, accumulate=2, grad_clip=0.05, lr_scheduler=step_lr, progress=False)
    ref, history = reference(cnn(), 2, accumulate=2, clip=0.05, scheduler=step_lr)
    same_state(comm, result.model.state_dict(), ref.state_dict(), 1e-10, f"grid {grid} x {samples}")
    assert_all_ranks(comm, all(abs(h["loss"] - e) < 1e-10 for h, e in zip(result.history, history)),
                     f"losses {[h['loss'] for h in result.history]} vs {history}")
    assert_all_ranks(comm, [h["lr"] for h in result.history] == [0.2, 0.1], f"lr {result.history}")


def test_bf16_runs_the_forward_under_autocast_close_to_one_process(comm):
    grid, samples = hybrid_layouts(comm.size)[0]
    model, dtypes = cnn(torch.float32), []
    model[-1].register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    result = fit(model, dataset("plain", torch.float32), F.cross_entropy, sgd, strategy="spatial", grid=grid,
                 samples=samples, batch_size=B, epochs=1, precision="bf16", progress=False)
    ref, _ = reference(cnn(torch.float32), 1, precision="bf16", dtype=torch.float32)
    fp32, _ = reference(cnn(torch.float32), 1, dtype=torch.float32)
    assert_all_ranks(comm, dtypes and set(dtypes) == {torch.bfloat16}, f"head output dtypes {dtypes}")
    assert_all_ranks(comm, all(p.dtype == torch.float32 for p in result.model.parameters()), "parameters stay fp32")
    same_state(comm, result.model.state_dict(), ref.state_dict(), 2e-2, "bf16 vs one process bf16")
    moved = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), fp32.parameters()))
    assert_all_ranks(comm, moved > 0, "the bf16 reference differs from fp32 (the test can fail)")


@pytest.fixture
def shared_dir(comm, tmp_path) -> Path:
    """Rank 0's pytest directory, which every rank sees (one host) and pytest prunes."""
    return Path(comm.broadcast_object(str(tmp_path) if comm.rank == 0 else None))


def train(comm, layout, directory, dropout=0.3, **kw):
    grid, samples = layout
    torch.manual_seed(100 + comm.rank)  # dropout streams differ per rank
    return fit(cnn(dropout=dropout), dataset("plain"), F.cross_entropy, sgd, strategy="spatial", grid=grid,
               samples=samples, batch_size=B, epochs=2, checkpoint_dir=directory, checkpoint_every=2,
               grad_clip=0.5, lr_scheduler=step_lr, progress=False, **kw)


def optimizer_state(path: Path, rank: int) -> dict:
    return checkpoint.read_shard(checkpoint.latest(path), rank)["trainer"]


@pytest.mark.parametrize("which", [0, 1], ids=["spatial", "hybrid"])
def test_stopped_run_resumes_bit_identical_and_load_checkpoint_consolidates(comm, shared_dir, which):
    layout = hybrid_layouts(comm.size)[which]
    root = shared_dir
    try:
        full = train(comm, layout, root / "full")
        stopped = train(comm, layout, root / "part", on_step_end=lambda s: s.step == 4)  # mid-epoch 2
        steps = sorted(p.name for p in (root / "part").iterdir())
        resumed = train(comm, layout, root / "part", resume=True)
        ok = bitwise_equal(resumed.model.state_dict(), full.model.state_dict())
        ok = ok and bitwise_equal(optimizer_state(root / "part", comm.rank), optimizer_state(root / "full", comm.rank))
        assert_all_ranks(comm, ok, "resumed weights, buffers or optimizer state differ from the full run")
        assert_all_ranks(comm, steps == ["step-2", "step-4"] and len(stopped.history) == 2, f"{steps}")
        assert_all_ranks(comm, [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history],
                         f"{resumed.history} vs {full.history}")
        consolidated = checkpoint.load_checkpoint(root / "part")
        assert_all_ranks(comm, bitwise_equal(consolidated, full.model.state_dict()), "load_checkpoint")
        cnn().load_state_dict(checkpoint.load_checkpoint(root / "full" / "step-2"))  # the user's class takes it
    finally:
        assert_all_ranks(comm, True)  # every rank is done with the directory
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def test_resume_on_another_layout_continues_from_the_replicated_state(comm, shared_dir):
    layouts = hybrid_layouts(comm.size)
    root = shared_dir
    try:
        full = train(comm, layouts[0], root / "full", dropout=0.0)
        train(comm, layouts[0], root / "part", dropout=0.0, on_step_end=lambda s: s.step == 3)
        resumed = train(comm, layouts[1], root / "part", dropout=0.0, resume=True)
        same_state(comm, resumed.model.state_dict(), full.model.state_dict(), 1e-10,
                   f"saved on {layouts[0]}, resumed on {layouts[1]}")
    finally:
        assert_all_ranks(comm, True)
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def test_region_reads_work_in_dataloader_worker_processes(comm):
    """rank_view's BlockReader holds no communicator: a DataLoader worker process reads the blocks."""
    grid, samples = hybrid_layouts(comm.size)[0]
    data = dataset("regions")
    copy.deepcopy(data)  # picklable/copyable: what a worker process needs
    result = fit(cnn(), data, F.cross_entropy, sgd, strategy="spatial", grid=grid, samples=samples, batch_size=B,
                 epochs=1, num_workers=1, progress=False)
    ref, _ = reference(cnn(), 1)
    same_state(comm, result.model.state_dict(), ref.state_dict(), 1e-10, "num_workers=1")


def test_bf16_halo_layers_follow_autocast_like_one_process(comm):
    """Under autocast the halo conv, transposed conv and upsampling compute in bf16 as torch's layers do."""
    from mpitrain.spatial import Distribution, gather, parallelize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, 1, 1), nn.ConvTranspose2d(3, 2, 3, 2, 1), nn.ReLU(),
                          nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(2, 2, 5, 1, 2))
    ref = copy.deepcopy(model)
    dist = Distribution(comm, (comm.size, 1), 1)
    x = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gather(parallelize(model, dist)(dist.scatter(x)))
        expected = ref(x)
    y.float().square().sum().backward()
    expected.float().square().sum().backward()
    assert_all_ranks(comm, y.dtype == expected.dtype == torch.bfloat16, f"dtypes {y.dtype}, {expected.dtype}")
    assert_close_all_ranks(comm, y.float(), expected.float(), 3e-2, 3e-2, "bf16 output")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_all_ranks(comm, p.grad is not None and p.grad.dtype == torch.float32, f"{name}.grad dtype")
        scale = q.grad.abs().max().item()
        assert_close_all_ranks(comm, p.grad / scale, q.grad / scale, 3e-2, 0, f"{name}.grad (relative to its max)")


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_batchnorm_under_autocast_computes_what_torchs_mixed_dtype_kernel_does(comm, low):
    """A float16/bfloat16 block (a conv's output under autocast) through global-statistics SpatialBatchNorm:
    torch's layer in one process takes its mixed-dtype path (statistics, running buffers and the backward's
    sums in float32, the output in the block's dtype). The spatial form must too: statistics rounded to the
    block's dtype (a float16 mean near 6 off by up to 2e-3) shift every output and the weight gradients.
    Channel means (the conv's bias, 6) large against the spread, as un-normalised inputs give."""
    from mpitrain.spatial import Distribution, gather, parallelize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, 1, 1), nn.BatchNorm2d(3), nn.Tanh(), nn.Conv2d(3, 2, 1))
    with torch.no_grad():
        model[0].bias.fill_(6.0)
    ref = copy.deepcopy(model)
    dist = Distribution(comm, (comm.size, 1), 1)
    x = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=low):
        y = gather(parallelize(model, dist)(dist.scatter(x)))
        expected = ref(x)
    y.float().square().sum().backward()
    expected.float().square().sum().backward()
    assert_all_ranks(comm, y.dtype == expected.dtype == low, f"dtypes {y.dtype}, {expected.dtype}")
    ulp = torch.finfo(low).eps
    assert_close_all_ranks(comm, y.float(), expected.float(), 2 * ulp, 2 * ulp, "output")
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
        assert_close_all_ranks(comm, p.double(), q.double(), 1e-6, 1e-6, name)  # running buffers, float32
    # relative to the largest gradient: the conv's bias before the batch norm has 0 as exact gradient (a shift
    # the normalisation removes), both sides hold rounding noise there
    scale = max(q.grad.abs().max().item() for q in ref.parameters())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close_all_ranks(comm, p.grad / scale, q.grad / scale, 4 * ulp, 0, f"{name}.grad (relative)")
