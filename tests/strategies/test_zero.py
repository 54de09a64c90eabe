"""ZeRO stages 1-3 (DataParallel, fit's data and hybrid strategies) against one process over real MPI at
2, 3 and 4 ranks, float64; the bytes each rank holds; refusals; checkpoints resumed at another world
size, layout, ZeRO stage or strategy, ending equal to one process's uninterrupted run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpitrain import checkpoint
from mpitrain.fit import FitError, fit
from mpitrain.strategies.data_parallel import DataParallel
from tests.helpers import assert_all_ranks, assert_close_all_ranks
from tests.strategies.pipeline.test_trainer_mpi import tied
from tests.test_fit_dataset import Points, order_batches, reference

pytestmark = pytest.mark.mpi

ATOL = 1e-12  # float64 after a few steps: only the order of additions differs from one process
# buckets of at most 1 KiB (the first 128 B): Net spans four, its parameters straddle the ranks' blocks
TINY = {"bucket_mb": 1 / 1024, "first_bucket_mb": 0.125 / 1024}
OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
}


class Net(nn.Module):
    """Odd sizes (blocks cut parameters anywhere), a LayerNorm, a parameter no forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(7, 13), nn.Linear(13, 11), nn.Linear(11, 5)
        self.norm = nn.LayerNorm(11)
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.norm(self.b(torch.relu(self.a(x))))))


def net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def rows(n: int, comm) -> slice:
    """This rank's block of n rows (the first n % size ranks one longer)."""
    sizes = [len(r) for r in torch.arange(n).tensor_split(comm.size)]
    start = sum(sizes[:comm.rank])
    return slice(start, start + sizes[comm.rank])


def same(comm, got: nn.Module, want: nn.Module, what: str, atol: float = ATOL) -> None:
    for (name, p), q in zip(got.state_dict().items(), want.state_dict().values()):
        assert_close_all_ranks(comm, p.double(), q.double(), atol=atol, what=f"{what}: {name}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dataparallel_zero_steps_like_one_process_for_adam_adamw_and_momentum_sgd(comm, stage):
    """Uneven rows per rank, two backward passes accumulated per step, the global norm clipped."""
    g = torch.Generator().manual_seed(1)
    for name, make in OPTIMIZERS.items():
        ref, model = net(), net()
        dp = DataParallel(model, zero=stage, **TINY)
        opt, ref_opt = dp.shard_optimizer(make(dp.parameters())), make(ref.parameters())
        assert_all_ranks(comm, len(dp.buckets) >= 4, f"expected several buckets, got {len(dp.buckets)}")
        for _ in range(3):
            opt.zero_grad()
            ref_opt.zero_grad()
            for _ in range(2):  # accumulation: each backward adds to the gradients (at stage >= 2, reduced)
                n = 2 * comm.size + 1
                x, y = torch.randn(n, 7, generator=g, dtype=torch.float64), torch.randn(n, 5, generator=g,
                                                                                        dtype=torch.float64)
                r = rows(n, comm)
                (F.mse_loss(dp(x[r]), y[r]) * (r.stop - r.start) * comm.size / n).backward()
                F.mse_loss(ref(x), y).backward()
            dp.clip_grad_norm_(0.05)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            opt.step()
            ref_opt.step()
        dp.close()
        same(comm, model, ref, f"zero={stage} {name}")
        assert_all_ranks(comm, model.unused.weight.grad is None and all(
            q.grad is None for s in dp.zero.shards for c, q in zip(s.pieces, s.piece_params)
            if s.params[c.param] is model.unused.weight), "a parameter no rank used got a gradient")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_collectives_all_run_on_its_one_reducer_thread_and_no_engine_thread_exists(comm, stage):
    """Issue #29 item 1: ZeRO's allreduces (1), reduce-scatters (2, 3) and allgathers go through its
    Reducer's ordered ops, so each runs on that reducer's one worker thread, and no engine thread is made."""
    import threading

    model = net()
    dp = DataParallel(model, zero=stage, **TINY)
    opt = dp.shard_optimizer(OPTIMIZERS["sgd"](dp.parameters()))
    private = dp.zero._reducer.comm
    ran: list[tuple[str, str]] = []
    def recorder(op: str):
        call = getattr(private, op)

        def record(*args, **kwargs):
            ran.append((op, threading.current_thread().name))
            return call(*args, **kwargs)
        return record

    for op in ("allreduce", "reduce_scatter", "allgather"):
        setattr(private, op, recorder(op))
    x = torch.randn(comm.size * 2, 7, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        dp(x[rows(len(x), comm)]).sum().backward()
        opt.step()
    engines = [t.name for t in threading.enumerate() if t.name.startswith("engine-")]
    dp.close()
    kinds = {k for k, _ in ran}
    want = {"allreduce", "allgather"} if stage == 1 else {"reduce_scatter", "allgather"}
    threads = {t for _, t in ran}
    assert_all_ranks(comm, kinds == want and threads == {f"mpitrain-{dp.zero.name}"} and not engines,
                     f"stage {stage}: ops {kinds}, threads {threads}, engine threads {engines}")


def test_zero3_holds_parameters_whole_only_around_their_use(comm):
    """Between steps no bucket is gathered; inside a module's forward its own buckets are, plus at most a
    prefetched one and the ones whose other modules have not run yet."""
    model = net()
    dp = DataParallel(model, zero=3, **TINY)
    opt = dp.shard_optimizer(OPTIMIZERS["adam"](dp.parameters()))
    seen = []

    def count(module, args, out):
        seen.append(sum(s.gathered for s in dp.zero.shards))

    for m in (model.a, model.b, model.c):
        m.register_forward_hook(count)
    x = torch.randn(comm.size * 2, 7, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        dp(x[rows(len(x), comm)]).sum().backward()
        opt.step()
        idle = sum(s.gathered for s in dp.zero.shards)
        assert_all_ranks(comm, idle == 0, f"{idle} buckets gathered between steps")
    total = len(dp.zero.shards)
    assert_all_ranks(comm, max(seen) <= 3 and total >= 4, f"gathered at once {seen} of {total} buckets")
    dp.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_held_per_rank_shrink_by_stage_to_the_targets(comm, stage):
    """Params + grads + Adam state held per rank after a step, over one process's (4 equal parts): stage 1
    keeps (2 + 2/N)/4, stage 2 (1 + 3/N)/4, stage 3 1/N (at 4 ranks: 0.625, 0.4375, 0.25 <= the issue's
    0.70, 0.50, 0.35); padding to equal blocks adds at most N - 1 elements per bucket."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(4)]).double()
    dp = DataParallel(model, zero=stage, bucket_mb=0.04, first_bucket_mb=0.04)
    opt = dp.shard_optimizer(torch.optim.Adam(dp.parameters(), lr=0.01))
    dp(torch.randn(comm.size, 64, dtype=torch.float64)[rows(comm.size, comm)]).sum().backward()
    opt.step()
    held = dp.held_bytes(opt)
    one = 4 * sum(p.numel() * 8 for p in model.parameters())  # params, grads, exp_avg, exp_avg_sq
    n = comm.size
    want = {0: 1.0, 1: (2 + 2 / n) / 4, 2: (1 + 3 / n) / 4, 3: 1 / n}[stage]
    ratio = (held["params"] + held["grads"] + held["optimizer"]) / one
    slack = len(dp.buckets) * 4 * (n - 1) * 8 / one + 64 / one  # padding; Adam's step counters
    targets = {0: 1.01, 1: 0.70, 2: 0.50, 3: 0.35}  # the last rank's block holds the padding: it may hold less
    assert_all_ranks(comm, abs(ratio - want) <= slack and (n != 4 or ratio <= targets[stage]),
                     f"zero={stage}: held {held}, ratio {ratio:.4f}, expected {want:.4f}")
    opt.zero_grad()  # from stage 2 the reduced blocks go too (not held through the next backward)
    cleared = dp.held_bytes(opt)["grads"]
    assert_all_ranks(comm, stage < 2 or cleared == 0, f"zero={stage}: {cleared} gradient bytes after zero_grad")
    dp.close()


def test_drop_state_gives_the_freed_optimizer_state_back_to_the_kernel(comm):
    """``trained_model`` frees the optimizer state (``Zero.drop_state``) before stage 3 gathers the whole
    model: the memory must leave the resident set, not stay in glibc's heap under the gathered model. Pieces
    under the mmap threshold (1 MiB / N here, as rank 0's 4,188,160-byte pieces were under 4 MiB in
    ``bench memory --zero``) come from the heap, which the launcher's 1 GiB trim threshold keeps resident
    when freed; without the trim in drop_state the resident set barely moves."""
    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(32)])  # 32 MiB of float32
    dp = DataParallel(model, zero=3, bucket_mb=1.0, first_bucket_mb=1.0)
    opt = dp.shard_optimizer(torch.optim.Adam(dp.parameters(), lr=0.01))
    dp(torch.randn(comm.size, 512)[rows(comm.size, comm)]).sum().backward()
    opt.step()
    state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim())
    before = resident()
    dp.zero.drop_state(opt)
    returned = before - resident()
    assert_all_ranks(comm, returned >= 0.8 * state,
                     f"drop_state returned {returned >> 10} KiB of {state >> 10} KiB of optimizer state")
    dp.close()


def _mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fit_zero_with_scheduler_clipping_accumulation_and_uneven_batches_equals_one_process(comm, stage):
    ds = Points(n=29)  # global batches of 8, 8, 8, 5

    def sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    adamw = OPTIMIZERS["adamw"]
    result = fit(_mlp(), ds, F.cross_entropy, adamw, strategy="data", zero=stage, batch_size=8, epochs=2,
                 accumulate=2, grad_clip=0.05, lr_scheduler=sched, progress=False, **TINY)
    ref, _, _ = reference(_mlp(), order_batches(ds, 2), accumulate=2, clip=0.05, scheduler=sched, optimizer=adamw)
    same(comm, result.model, ref, f"fit zero={stage}")


def test_fit_zero_bf16_matches_one_process_autocast(comm):
    ds = Points(n=29, dtype=torch.float32)
    adam = OPTIMIZERS["adam"]
    ref, _, _ = reference(_mlp(torch.float32), order_batches(ds, 1), precision="bf16", optimizer=adam)
    for stage in (1, 2, 3):
        result = fit(_mlp(torch.float32), ds, F.cross_entropy, adam, strategy="data", zero=stage, batch_size=8,
                     precision="bf16", progress=False, **TINY)
        same(comm, result.model, ref, f"bf16 zero={stage}", atol=2e-2)


@pytest.mark.parametrize("stage,schedule", [(1, "1f1b"), (2, "1f1b"), (2, "zb1p")])
def test_hybrid_zero_shards_each_partition_over_its_replicas_like_one_process(comm, stage, schedule):
    """Tied weights across partitions (their copies' gradients summed before the replicas reduce),
    clipping, a scheduler, accumulation, an uneven last batch; under zb1p the deferred weight passes
    land before the replicas reduce-scatter."""
    P = comm.size // 2 if comm.size % 2 == 0 else 1
    if schedule == "zb1p" and P < 2:
        pytest.skip("zb1p needs two partitions: 4 ranks")
    ds = Points(n=29)

    def sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    adamw = OPTIMIZERS["adamw"]
    result = fit(tied(), ds, F.cross_entropy, adamw, strategy="hybrid", partitions=P, micro_batches=2, zero=stage,
                 schedule=schedule, batch_size=8, epochs=2, accumulate=2, grad_clip=0.05, lr_scheduler=sched,
                 balance="params", progress=False)
    ref, _, _ = reference(tied(), order_batches(ds, 2), accumulate=2, clip=0.05, scheduler=sched, optimizer=adamw)
    same(comm, result.model, ref, f"hybrid P={P} R={comm.size // P} zero={stage} {schedule}", atol=1e-10)


def test_what_zero_cannot_shard_is_refused_on_every_rank_before_any_message(comm):
    lbfgs = lambda ps: torch.optim.LBFGS(ps)  # noqa: E731
    for kw, match in (({"strategy": "data", "zero": 1}, "cannot shard LBFGS"),
                      ({"strategy": "hybrid", "partitions": 1, "zero": 2}, "cannot shard LBFGS")):
        with pytest.raises(FitError, match=match):
            fit(_mlp(), Points(), F.cross_entropy, lbfgs, batch_size=8, progress=False, **kw)
    for kw, match in (({"strategy": "data", "zero": 4}, "zero must be one of"),
                      ({"strategy": "hybrid", "partitions": 1, "zero": 3}, "zero=3")):
        with pytest.raises(FitError, match=match):
            fit(_mlp(), Points(), F.cross_entropy, OPTIMIZERS["adam"], batch_size=8, progress=False, **kw)
    with pytest.raises(FitError, match="zero=3: a global batch of 1 samples"):  # Points(17): last batch 1
        fit(_mlp(), Points(), F.cross_entropy, OPTIMIZERS["adam"], strategy="data", zero=3, batch_size=8,
            progress=False)
    dp = DataParallel(_mlp(), zero=2)
    with pytest.raises(RuntimeError, match="no_sync"):
        with dp.no_sync():
            pass
    dp.close()


def _layouts(size: int) -> list[tuple[dict[str, object], int, dict[str, object], int]]:
    """(saved run's options, its ranks, resumed run's options, its ranks) for this world size."""
    half = max(size // 2, 1)
    cases = [({"strategy": "data", "zero": 2}, size, {"strategy": "data", "zero": 0}, size - 1),
             ({"strategy": "data", "zero": 0}, size - 1, {"strategy": "data", "zero": 3}, size),
             ({"strategy": "model", "partitions": size}, size, {"strategy": "model", "partitions": 2}, 2),
             ({"strategy": "model", "partitions": 2}, 2, {"strategy": "data", "zero": 1}, size)]
    if size == 4:  # hybrid 2 x 2 with sharded replicas -> model 2, and back at another split
        cases += [({"strategy": "hybrid", "partitions": 2, "zero": 2}, 4, {"strategy": "model", "partitions": 2}, 2),
                  ({"strategy": "data", "zero": 3}, 3, {"strategy": "hybrid", "partitions": 2, "zero": 1}, 4)]
    elif size > 2:
        cases += [({"strategy": "hybrid", "partitions": 1, "zero": 2}, size, {"strategy": "model",
                                                                             "partitions": half}, half)]
    return cases


def test_checkpoints_resume_at_another_world_size_layout_zero_stage_or_strategy(comm, tmp_path):
    """Save mid-run on some ranks, resume on others (every case of _layouts); the resumed run ends equal
    to one process's uninterrupted run, and load_checkpoint gives its state_dict in one process."""
    ds = Points(n=32)  # 4 global batches of 8 per epoch: every rank has rows for every layout
    adam = OPTIMIZERS["adam"]
    ref, _, _ = reference(_mlp(), order_batches(ds, 2), clip=0.05, optimizer=adam)
    common = {"batch_size": 8, "epochs": 2, "grad_clip": 0.05, "balance": "params", "progress": False}
    for i, (saved, n_saved, resumed, n_resumed) in enumerate(_layouts(comm.size)):
        directory = comm.broadcast_object(str(tmp_path / f"ckpt{i}"))
        for options, n, extra in ((saved, n_saved, {"on_step_end": lambda s: s.step == 5}),
                                  (resumed, n_resumed, {"resume": True})):
            micro = {"micro_batches": 2} if options["strategy"] != "data" else {}
            sub = comm.split(0 if comm.rank < n else None, comm.rank)
            if sub is not None:
                result = fit(_mlp(), ds, F.cross_entropy, adam, comm=sub, checkpoint_dir=directory, **common,
                             **options, **micro, **extra)
                sub.free()
        what = f"{saved} on {n_saved} -> {resumed} on {n_resumed}"
        if comm.rank < n_resumed:
            err = max((a - b).abs().max().item() for a, b in zip(result.model.state_dict().values(),
                                                                   ref.state_dict().values()))
        else:
            err = 0.0
        assert_all_ranks(comm, err <= 1e-10, f"{what}: resumed run differs from one process by {err}")
        merged = checkpoint.load_checkpoint(directory)
        assert_all_ranks(comm, max((merged[k] - v).abs().max().item() for k, v in ref.state_dict().items()) <= 1e-10,
                         f"{what}: load_checkpoint")


def test_fit_zero_keeps_parameters_identical_on_every_rank(comm):
    result = fit(_mlp(), Points(n=29), F.cross_entropy, OPTIMIZERS["adam"], strategy="data", zero=3, batch_size=8,
                 progress=False, **TINY)
    for name, t in result.model.state_dict().items():
        theirs = comm.allgather(t.reshape(1, -1).contiguous())
        assert_all_ranks(comm, bool((theirs == theirs[0]).all()), f"{name} differs between ranks")



def test_zero3_over_host_staging_keeps_what_autograd_saved_and_equals_one_process(comm):
    """Stage 3 over the MPI backend's host-staging path (CUDA tensors without CUDA-aware MPI; forced here
    for CPU tensors): a gather's result is copied into the bucket's flat buffer, a write counted on the
    buffer's version counter (MPI's direct write is counted nowhere). Backward gathers again the
    parameters forward saved (a Linear's weight); they view the buffer through ``p.data = view``, which
    keeps each parameter's own counter, so autograd's saved-tensor check passes without any version
    handling in ``Zero.gather``: the buffers' counters move, the parameters' do not, and three steps equal
    one process."""
    from mpitrain.comm.compose import mpi_communicator

    if comm.backend != "mpi":
        pytest.skip("host staging is the MPI backend's path")
    staged = mpi_communicator(comm.mpi_comm, direct=frozenset())
    g = torch.Generator().manual_seed(2)
    ref, model = net(), net()
    dp = DataParallel(model, comm=staged, zero=3, **TINY)
    opt, ref_opt = dp.shard_optimizer(OPTIMIZERS["adam"](dp.parameters())), OPTIMIZERS["adam"](ref.parameters())
    flats = [s.flat._version for s in dp.zero.shards]
    params = [p._version for p in model.parameters()]
    error = ""
    for _ in range(3):
        n = 2 * comm.size + 1
        x, y = torch.randn(n, 7, generator=g, dtype=torch.float64), torch.randn(n, 5, generator=g, dtype=torch.float64)
        r = rows(n, comm)
        opt.zero_grad()
        ref_opt.zero_grad()
        try:
            (F.mse_loss(dp(x[r]), y[r]) * (r.stop - r.start) * comm.size / n).backward()
        except RuntimeError as e:  # the same on every rank: each gathers the same buckets
            error = str(e).splitlines()[0]
            break
        F.mse_loss(ref(x), y).backward()
        opt.step()
        ref_opt.step()
    assert_all_ranks(comm, not error, f"stage-3 backward over staging: {error}")
    moved = [s.flat._version - v for s, v in zip(dp.zero.shards, flats)
             if not any(p is model.unused.weight for p in s.params)]  # no forward gathers that one
    kept = [p._version - v for p, v in zip(model.parameters(), params)]
    assert_all_ranks(comm, all(m > 0 for m in moved) and not any(kept),
                     f"version counters: the buffers' moved by {moved}, the parameters' by {kept}")
    dp.close()
    same(comm, model, ref, "zero=3 over staging")
