"""mpitrain.horovod calls parameterised by device, shared by the CPU tests (test_device_paths.py: the engine
over the MPI backend's host staging, forced for CPU tensors) and the CUDA tests (tests/gpu/test_gpu_horovod.py):
the same calls on two paths must give bitwise equal results, and training must match one process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

import mpitrain.horovod as hvd
from mpitrain.horovod import _basics
from tests.helpers import assert_all_ranks
from tests.strategies import _device_checks as dc

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.uint8, torch.int8, torch.int16]


@contextlib.contextmanager
def engine_over(world: Any) -> Iterator[None]:
    """mpitrain.horovod restarted over `world` (a Communicator over the whole job) instead of mpitrain's
    world, then restarted as usual. Collective: every rank enters and leaves together."""
    saved = _basics._mpitrain_init
    hvd.shutdown()
    _basics._mpitrain_init = lambda: world  # init() takes its world from here
    try:
        hvd.init()
        yield
    finally:
        hvd.shutdown()
        _basics._mpitrain_init = saved
        hvd.init()


def data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rank-dependent values that every dtype holds (integers small and non-negative for uint8)."""
    g = torch.Generator().manual_seed(7919 * rank + 31 * seed + len(shape))
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    if dtype.is_floating_point:
        return x.to(dtype)
    return (x.abs() if dtype == torch.uint8 else x).round().to(dtype)


class Results:
    """Named results of the calls below, moved to the CPU; `misplaced` names those that were not on the
    input's device (received splits: on the CPU, as Horovod's)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.out: dict[str, torch.Tensor] = {}
        self.misplaced: list[str] = []

    def add(self, name: str, t: torch.Tensor, device: torch.device | None = None) -> None:
        if t.device.type != (device or self.device).type:
            self.misplaced.append(f"{name} on {t.device}")
        self.out[name] = t.detach().cpu()


def run_collectives(device: torch.device) -> Results:
    """Every collective on inputs on `device`: sync and async, in place and not, single and grouped
    (fused), every op and dtype where it matters (integer Average truncates), pre/post scaling, varying
    first dims, each root, equal and uneven alltoall splits, and one backward pass."""
    r, n = hvd.rank(), hvd.size()
    res = Results(device)

    def x(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
        return data(r, shape, dtype, seed).to(device)

    for dtype in FLOATS + INTS:
        res.add(f"allreduce avg {dtype}", hvd.allreduce(x((5, 3), dtype), op=hvd.Average))
        res.add(f"allreduce sum {dtype}", hvd.allreduce(x((7,), dtype), op=hvd.Sum))
    for op, name in ((hvd.Min, "min"), (hvd.Max, "max"), (hvd.Product, "prod")):
        for dtype in (torch.float32, torch.int32):
            res.add(f"allreduce {name} {dtype}", hvd.allreduce(x((6,), dtype, 1), op=op))
    for dtype in (torch.float32, torch.float16, torch.int32):
        res.add(f"allreduce scaled {dtype}", hvd.allreduce(x((9,), dtype, 2), op=hvd.Average,
                                                           prescale_factor=0.5, postscale_factor=3.0))
    t = x((4, 4), torch.float32, 3)
    hvd.allreduce_(t, op=hvd.Sum)
    res.add("allreduce_", t)
    handles = [hvd.allreduce_async(x((11,), torch.float64, 4 + i), name=f"a{i}") for i in range(3)]
    t = x((3, 5), torch.float32, 7)
    h_inplace = hvd.allreduce_async_(t, op=hvd.Sum)
    for i, h in enumerate(handles):
        res.add(f"allreduce_async {i}", hvd.synchronize(h))
    hvd.synchronize(h_inplace)
    res.add("allreduce_async_", t)
    group = [x((3,), torch.float32, 8), x((2, 2), torch.float32, 9), x((5,), torch.float64, 10),
             x((4,), torch.int8, 11), x((), torch.float32, 12)]
    for i, g in enumerate(hvd.grouped_allreduce(group, op=hvd.Average)):
        res.add(f"grouped_allreduce {i}", g)
    h = hvd.grouped_allreduce_async_(group, op=hvd.Sum)
    hvd.synchronize(h)
    for i, g in enumerate(group):
        res.add(f"grouped_allreduce_async_ {i}", g)

    for dtype in (torch.float32, torch.int16, torch.bfloat16):
        res.add(f"allgather {dtype}", hvd.allgather(x((r + 1, 3), dtype, 13)))
    res.add("allgather_async", hvd.synchronize(hvd.allgather_async(x((2, 2), torch.float64, 14))))
    for i, g in enumerate(hvd.grouped_allgather([x((r + 2,), torch.float32, 15), x((1, 3), torch.int64, 16)])):
        res.add(f"grouped_allgather {i}", g)

    for root in range(n):
        res.add(f"broadcast {root}", hvd.broadcast(x((4, 2), torch.float32, 17), root))
        t = x((5,), torch.int8, 18)
        hvd.broadcast_(t, root)
        res.add(f"broadcast_ {root}", t)
        t = x((3,), torch.float16, 19)
        hvd.synchronize(hvd.broadcast_async_(t, root))
        res.add(f"broadcast_async_ {root}", t)

    res.add("alltoall equal", hvd.alltoall(x((2 * n, 3), torch.float32, 20)))
    splits = [(r + q) % 3 for q in range(n)]
    out, received = hvd.alltoall(x((sum(splits) + 1, 2), torch.int32, 21), splits=splits)
    res.add("alltoall splits", out)
    res.add("alltoall received", received, torch.device("cpu"))
    out, received = hvd.synchronize(hvd.alltoall_async(x((n, 2), torch.float64, 22)))
    res.add("alltoall_async", out)
    res.add("alltoall_async received", received, torch.device("cpu"))

    res.add("reducescatter avg", hvd.reducescatter(x((2 * n + 1, 2), torch.float32, 23)))
    res.add("reducescatter sum int", hvd.reducescatter(x((n + 1,), torch.int32, 24), op=hvd.Sum))

    leaf = x((4, 3), torch.float32, 25).requires_grad_()
    (hvd.allreduce(leaf, op=hvd.Sum) * x((4, 3), torch.float32, 26)).sum().backward()
    assert leaf.grad is not None
    res.add("allreduce backward", leaf.grad)
    return res


def assert_same_results(comm: Any, got: Results, want: Results, bitwise: bool = True) -> None:
    """`got` (on its device) equals `want`: bitwise, or (CUDA-aware MPI, which may sum device buffers
    in another order) within rounding; and every result was on its input's device."""
    assert_all_ranks(comm, not got.misplaced, f"results not on the input's device: {got.misplaced}")
    bad = []
    for name, w in want.out.items():
        g = got.out.get(name)
        if g is None or g.dtype != w.dtype or g.shape != w.shape:
            bad.append(f"{name}: {None if g is None else (g.dtype, tuple(g.shape))} vs {w.dtype, tuple(w.shape)}")
        elif bitwise or not w.is_floating_point():
            if not torch.equal(g, w):
                bad.append(name)
        elif not torch.allclose(g.double(), w.double(), rtol=1e-2 if w.itemsize == 2 else 1e-6, atol=1e-6):
            bad.append(name)
    assert_all_ranks(comm, not bad, f"{len(bad)} results differ: {bad[:10]}")


def train_distributed_optimizer(device: torch.device, bucket_mb: float = 0.0005) -> list[torch.Tensor]:
    """dc.STEPS steps of SGD (momentum) wrapped in hvd.DistributedOptimizer (small buckets: several per
    step) on the tiny CNN on `device`, each rank on its slice of the global batch, after
    broadcast_parameters/broadcast_optimizer_state from rank 0; parameters on the CPU."""
    r = hvd.rank()
    model = dc.fresh_model(device)
    if r != 0:  # broadcast_parameters must make them rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), bucket_mb=bucket_mb,
                                   first_bucket_mb=bucket_mb / 16)
    for xb, yb in dc.global_batches(hvd.size()):
        rows = slice(r * dc.PER_RANK, (r + 1) * dc.PER_RANK)
        opt.zero_grad()
        F.cross_entropy(model(xb[rows].to(device)), yb[rows].to(device)).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def assert_adam_state_broadcast(comm: Any, device: torch.device) -> None:
    """Rank 0 takes one Adam step (its ``step`` stays on the CPU, the moments live on `device`: two
    fused broadcasts per dtype); after broadcast_optimizer_state every rank's fresh optimizer holds
    rank 0's state bitwise, the moments on `device`."""
    model = dc.fresh_model(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if hvd.rank() == 0:
        xb, yb = dc.global_batches(1, steps=1)[0]
        F.cross_entropy(model(xb.to(device)), yb.to(device)).backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = [(k, v) for st in opt.state.values() for k, v in st.items()]
    moved = [k for k, v in state if k.startswith("exp_avg") and v.device.type != device.type]
    mine = [v.detach().cpu() for _, v in state]
    root = comm.broadcast_object(mine, 0)
    ok = len(state) == 3 * len(list(model.parameters())) and len(root) == len(mine) and not moved
    assert_all_ranks(comm, ok and all(torch.equal(a, b) for a, b in zip(mine, root)),
                     f"Adam state differs from rank 0's (or is not on {device}: {moved})")
