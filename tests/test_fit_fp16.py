"""`fit(..., precision="fp16")`: float16 autocast with dynamic loss scaling whose verdict is the job's.

Against one process running a plain loop with ``torch.autocast("cpu", torch.float16)`` and
``torch.amp.GradScaler("cpu")`` on the whole global batch (same init scale and growth interval), over real
MPI at 2, 3 and 4 ranks, for every strategy: the parameters after the steps agree (the shares' float16
rounding differs from the whole batch's: a tolerance suited to fp16 autocast, far below what a step
without unscaling or a step skipped on some ranks only gives), and the scale and the skipped steps are
the one process's, equal on every rank. A run starting at scale 2**40 overflows its first steps: every
rank skips the same ones, the LR scheduler is not stepped on them, no weight is NaN. Resume is
bit-identical (the scaler's state is in the checkpoint)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpitrain.fit import PRECISIONS, FitError, _loop_spec, fit
from mpitrain.spatial.mesh import mesh_batch, mesh_model
from tests.helpers import assert_all_ranks, assert_close_all_ranks, bitwise_equal

# The scale moves by x16 (GradScaler's growth_factor / backoff_factor; growth_interval 3, so the runs grow it
# too): the overflow verdict reads float16 values, and a share's differ from the whole batch's by rounding and
# by the share's mean of per-sample gradients, so a scale within a few percent of the overflow threshold may
# overflow in one and not the other; x16 steps keep every scale the runs try far from this model's threshold
# (between 2**17 and 2**18), so the job's verdict must be the one process's at every step.
INIT = 2.0 ** 12
GROWTH = 3
FACTOR = 16.0


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def batches(count: int = 8, rows: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches of `rows` rows (uneven over 3 ranks' micro-batches too), float32."""
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(rows, 6, generator=g) * 3, torch.randint(0, 3, (rows,), generator=g)) for _ in range(count)]


def scaler(init: float = INIT) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=init, growth_factor=FACTOR, backoff_factor=1 / FACTOR,
                                growth_interval=GROWTH)


def one_process(model: nn.Module, data: list[Any], loss_fn: Any = F.cross_entropy, init: float = INIT,
                clip: float | None = None, scheduler: Any = None) -> tuple[nn.Module, float, int, list[float]]:
    """The plain loop: autocast fp16 + GradScaler on each whole global batch. Returns the model, the final
    scale, the skipped steps and the learning rate of each step; the scheduler steps only after a step
    that was not skipped (fit's rule)."""
    opt = sgd(model.parameters())
    sched = scheduler(opt) if scheduler else None
    scale = scaler(init)
    skipped, lrs = 0, []
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scale.scale(loss).backward()
        scale.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = scale.get_scale()
        lrs.append(opt.param_groups[0]["lr"])
        scale.step(opt)
        scale.update()
        if scale.get_scale() < before:  # an overflow: GradScaler skipped the step
            skipped += 1
        elif sched is not None:
            sched.step()
    return model, scale.get_scale(), skipped, lrs


def close(comm, a: nn.Module, b: nn.Module, atol: float, what: str) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert_all_ranks(comm, bool(torch.isfinite(p).all()), f"{what}: {name} is not finite")
        assert_close_all_ranks(comm, p.double(), q.double(), atol, atol, f"{what}: {name}")


def same_scaler(comm, record: dict[str, Any], scale: float, skipped: int, what: str) -> None:
    """The job's scale and skipped count: the one process's, and the same on every rank."""
    mine = (record["loss_scale"], record["skipped_steps"])
    every = comm.allgather_object(mine)
    assert_all_ranks(comm, all(e == every[0] for e in every), f"{what}: ranks disagree on (scale, skipped): {every}")
    assert_all_ranks(comm, mine == (scale, skipped), f"{what}: (scale, skipped) {mine}, one process {(scale, skipped)}")


# name -> fit keywords; tolerance on the parameters
STRATEGIES: dict[str, dict[str, Any]] = {
    "data": {"strategy": "data"},
    "data-zero1": {"strategy": "data", "zero": 1, "bucket_mb": 0.0005},
    "data-zero2": {"strategy": "data", "zero": 2, "bucket_mb": 0.0005, "micro_batches": 2},
    "data-zero3": {"strategy": "data", "zero": 3, "bucket_mb": 0.0005},
    "model": {"strategy": "model", "micro_batches": 2, "balance": "params", "profile_passes": 1},
    "hybrid": {"strategy": "hybrid", "micro_batches": 2, "balance": "params", "profile_passes": 1},
    "pipe-sgd": {"strategy": "pipe-sgd", "staleness": 1},
}
# measured at 2, 3, 4 ranks: at most 2.0e-4 after 32 steps (weights move 0.23); a step without unscaling,
# or one skipped on some ranks only, moves them by far more
ATOL = 4e-4


def _options(name: str, size: int) -> dict[str, Any]:
    opts = dict(STRATEGIES[name])
    if name == "hybrid":
        opts.update(partitions=2, replicas=size // 2) if size % 2 == 0 else opts.update(partitions=1, replicas=size)
    return opts


# -- MPI: every strategy equals one process --------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_fp16_equals_one_process_gradscaler(comm, name):
    data = batches()
    result = fit(mlp(), data, F.cross_entropy, sgd, precision="fp16", grad_scaler=scaler(), grad_clip=5.0,
                 progress=False, **_options(name, comm.size))
    ref, scale, skipped, _ = one_process(mlp(), data, clip=5.0)
    close(comm, result.model, ref, ATOL, name)
    same_scaler(comm, result.history[-1], scale, skipped, name)
    assert_all_ranks(comm, scale > INIT, f"{name}: the scale never grew ({scale})")  # growth was exercised


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["data-zero1", "model", "pipe-sgd"])
def test_overflowing_steps_are_skipped_on_every_rank_as_one_process(comm, name):
    """Init scale 2**40: the first steps overflow; every rank skips those (and their scheduler steps),
    the scale halves as often as one process's, no weight is NaN."""
    data = batches(32)
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)  # noqa: E731
    lrs: list[float] = []
    result = fit(mlp(), data, F.cross_entropy, sgd, precision="16-mixed", grad_scaler=scaler(2.0 ** 40),
                 lr_scheduler=sched, on_step_end=lambda s: lrs.append(s.lr), progress=False,
                 **_options(name, comm.size))
    ref, scale, skipped, ref_lrs = one_process(mlp(), data, init=2.0 ** 40, scheduler=sched)
    assert_all_ranks(comm, 3 <= skipped <= len(data) - 5, f"the reference skipped {skipped} steps of {len(data)}")
    close(comm, result.model, ref, ATOL, name)
    same_scaler(comm, result.history[-1], scale, skipped, name)
    assert_all_ranks(comm, lrs == pytest.approx(ref_lrs, rel=1e-12), f"{name}: lrs {lrs} vs {ref_lrs}")


class TwoBranch(nn.Module):
    """Logits from 6 features plus a shift of class 0's from 4 others, the first of which is 150 in every
    row, and no target is class 0: the gradient of ``l2.weight[0, 0]`` is 150 x the mean probability of
    class 0 (about 50 at first, on every share: it overflows at scale 2**12 by x3 and no other element
    does), so under ZeRO only the rank whose piece holds that element finds the inf. The step after,
    at 2**8, drives class 0's probability to about 0: no further overflow."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(6, 3), nn.Linear(4, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(x[:, :6]) + F.pad(self.l2(x[:, 6:]), (0, 2))


def branch_batches(count: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        x = torch.randn(12, 10, generator=g)
        x[:, 6] = 150.0
        out.append((x, torch.randint(1, 3, (12,), generator=g)))
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["data-zero1", "data-zero2", "model"])
def test_an_overflow_one_rank_alone_finds_skips_the_step_on_every_rank(comm, name):
    """One element's gradient overflows: the rank holding it finds the inf, and the job's verdict skips the
    step everywhere (a rank-local verdict would step the others' pieces or partitions)."""
    data = branch_batches()
    result = fit(TwoBranch(), data, F.cross_entropy, sgd, precision="fp16", grad_scaler=scaler(), progress=False,
                 **_options(name, comm.size))
    ref, scale, skipped, _ = one_process(TwoBranch(), data)
    assert_all_ranks(comm, skipped == 1, f"the reference skipped {skipped} steps")
    close(comm, result.model, ref, ATOL, name)
    same_scaler(comm, result.history[-1], scale, skipped, name)


def spatial_model(bn: bool) -> nn.Module:
    """The mesh model at widths (4, 6). With `bn`: conv-BN-Tanh blocks (Tanh for ReLU: a BN output within
    rounding of 0 flips a ReLU's mask, and one flipped cell of a channel's 32 moves this tiny model's weights
    by 2e-2 within 6 steps; one process alone does that, its weights perturbed by 1e-5 before the run, so a
    ReLU model compares chaos, not arithmetic). Without: conv-ReLU blocks, the batch norms dropped."""
    torch.manual_seed(0)
    mesh = mesh_model(in_channels=3, widths=(4, 6), convs_per_block=1)
    if bn:
        return nn.Sequential(*[nn.Tanh() if isinstance(m, nn.ReLU) else m for m in mesh])
    return nn.Sequential(*[nn.Identity() if isinstance(m, nn.BatchNorm2d) else m for m in mesh])


@pytest.mark.mpi
@pytest.mark.parametrize("bn", [False, True], ids=["no-bn", "bn"])
def test_spatial_fp16_and_overflow_equal_one_process(comm, bn):
    """Halo convolutions, the loss on blocks and (`bn`) SpatialBatchNorm with global statistics, float32
    as torch's mixed-dtype kernel keeps them in one process (the layer itself against torch's:
    tests/spatial/test_runs.py, which fails with the statistics rounded to float16; this model's channel
    means are near 0, where that rounding stays below the tolerance)."""
    data = [mesh_batch(2, 16, in_channels=3, blocks=2, seed=s) for s in range(8)]
    loss_fn = nn.CrossEntropyLoss()
    # overflow thresholds: 2**19-2**20 without BN, about 2**18 with (a share's float16 weight gradient, a partial
    # sum, may stay finite at a scale the whole batch's overflows); the scales tried stay x4 or more from them.
    # The larger init overflows its first 3 steps (with BN also step 7, at the grown 2**20)
    for init in ((2.0 ** 8, 2.0 ** 28) if bn else (2.0 ** 10, 2.0 ** 26)):
        result = fit(spatial_model(bn), data, loss_fn, sgd, strategy="spatial", grid=(comm.size, 1),
                     precision="fp16", grad_scaler=scaler(init), progress=False)
        ref, scale, skipped, _ = one_process(spatial_model(bn), data, loss_fn, init=init)
        if init > INIT:
            assert_all_ranks(comm, skipped == (4 if bn else 3), f"the reference skipped {skipped} steps")
        close(comm, result.model, ref, ATOL, f"spatial, bn {bn}, init scale {init}")
        same_scaler(comm, result.history[-1], scale, skipped, f"spatial, bn {bn}, init scale {init}")


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["data-zero1", "model"])
def test_resume_is_bit_identical_with_the_scalers_state(comm, name, tmp_path_factory):
    """Stopped after 7 steps (steps 1, 2 and 6 skipped, step 7 the first of a growth interval of 3: the
    tracker is mid-interval), resumed: the same bits as the uninterrupted run."""
    data = batches(10)
    common = dict(precision="fp16", grad_scaler=scaler(2.0 ** 24), progress=False, **_options(name, comm.size))
    whole = fit(mlp(), data, F.cross_entropy, sgd, **common)
    where = comm.broadcast_object(str(tmp_path_factory.mktemp("fp16")) if comm.rank == 0 else None)
    fit(mlp(), data, F.cross_entropy, sgd, checkpoint_dir=where, checkpoint_every=7,
        on_step_end=lambda s: s.step == 7, **common)
    resumed = fit(mlp(), data, F.cross_entropy, sgd, checkpoint_dir=where, resume=True, **common)
    assert_all_ranks(comm, bitwise_equal(whole.model.state_dict(), resumed.model.state_dict()),
                     f"{name}: resumed weights differ")
    def steady(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in h.items() if k != "samples_per_s"} for h in history]

    assert_all_ranks(comm, steady(whole.history) == steady(resumed.history),
                     f"{name}: {whole.history} vs {resumed.history}")
    assert_all_ranks(comm, 0 < whole.history[-1]["skipped_steps"] < 7, f"skipped: {whole.history}")


@pytest.mark.mpi
def test_fp16_refusals_on_every_rank_before_any_message(comm):
    with pytest.raises(FitError, match="error_feedback"):
        fit(mlp(), batches(), F.cross_entropy, sgd, strategy="pipe-sgd", compression="fp16", error_feedback=True,
            precision="fp16", progress=False)
    with pytest.raises(FitError, match="precision must be"):
        fit(mlp(), batches(), F.cross_entropy, sgd, precision="16", progress=False)
    assert_all_ranks(comm, True)


# -- one process ------------------------------------------------------------------------------------------
def test_precision_spellings_and_grad_scaler_checks():
    assert {k: _loop_spec(None, k, None).precision for k in PRECISIONS} == PRECISIONS
    assert _loop_spec(None, "16-mixed", None).precision == "fp16"
    spec = _loop_spec(None, "fp16", torch.amp.GradScaler("cpu", init_scale=8.0, growth_factor=4.0,
                                                         backoff_factor=0.25, growth_interval=7)).scaler
    assert (spec.init_scale, spec.growth_factor, spec.backoff_factor, spec.growth_interval) == (8.0, 4.0, 0.25, 7)
    for bad in ("fp8", 16, None):
        with pytest.raises(FitError, match="precision must be"):
            _loop_spec(None, bad, None)  # type: ignore[arg-type]
    with pytest.raises(FitError, match="grad_scaler takes"):
        _loop_spec(None, "bf16", torch.amp.GradScaler("cpu"))
    with pytest.raises(FitError, match="grad_scaler takes"):
        _loop_spec(None, "fp16", torch.amp.GradScaler("cpu", enabled=False))
    assert math.isclose(_loop_spec(None, "fp16", None).scaler.init_scale, 2.0 ** 16)


def stale_one_process(model: nn.Module, data: list[Any], K: int, init: float) -> tuple[nn.Module, float, int]:
    """Pipe-SGD's Algorithm 1 in one process with fp16 loss scaling, written out: step t applies the
    gradient of t-K unscaled by the scale it was made with; a non-finite one skips that update and backs
    the scale off only if it was made with the current scale (GradScaler's numbers, plain Python)."""
    opt, params = sgd(model.parameters()), list(model.parameters())
    scale, tracker, skipped, pending = init, 0, 0, []
    for t, (x, y) in enumerate(data, 1):
        if pending and pending[0][0] == t - K:
            _, made, grads = pending.pop(0)
            finite = all(bool(torch.isfinite(g).all()) for g in grads)
            if finite:
                for p, g in zip(params, grads):
                    p.grad = g / made
                opt.step()
                tracker += 1
                if tracker == GROWTH:
                    scale, tracker = scale * FACTOR, 0
            else:
                skipped += 1
                if made <= scale:  # not made with a scale since backed off
                    scale, tracker = scale / FACTOR, 0
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        (loss * scale).backward()
        pending.append((t, scale, [p.grad.clone() for p in params]))
    return model, scale, skipped


@pytest.mark.mpi
def test_pipe_sgd_stale_gradients_are_unscaled_by_their_own_scale(comm):
    """Staleness 2 from scale 2**40: the two gradients in flight were made with scales since backed off;
    each is unscaled by its own, and an overflowing one made with a larger scale skips without a second
    back-off: the weights, scale and skipped count of the written-out algorithm."""
    data = batches(24)
    result = fit(mlp(), data, F.cross_entropy, sgd, strategy="pipe-sgd", staleness=2, precision="fp16",
                 grad_scaler=scaler(2.0 ** 40), progress=False)
    ref, scale, skipped = stale_one_process(mlp(), data, 2, 2.0 ** 40)
    assert_all_ranks(comm, 3 <= skipped <= len(data) - 8, f"the reference skipped {skipped} steps")
    close(comm, result.model, ref, ATOL, "pipe-sgd K=2")
    same_scaler(comm, result.history[-1], scale, skipped, "pipe-sgd K=2")
