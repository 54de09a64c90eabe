"""LR schedulers as torchvision's scripts and Lightning bring them: ``fit(lr_interval="epoch")`` steps the
scheduler once per epoch (after its evaluation), and a ReduceLROnPlateau is stepped per epoch with the
epoch record's ``lr_monitor`` value. Each run is checked against ONE process running the torchvision loop
(``for epoch: for batch: step; sched.step()`` / ``sched.step(value)``) in float64: the LR history and the
parameters after 3 epochs, under data (zero 0 and 1), model, hybrid, pipe-sgd K=1 (D-Sync: plain SGD) and
spatial, over real MPI at 2, 3 and 4 ranks; the plateau's monitored value and state are the same on every
rank; a run stopped mid-epoch and resumed ends bit-identical (scheduler state included); bad lr_interval /
lr_monitor are refused with FitError on every rank before any message."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler as sched

from mpitrain.fit import FitError, fit
from mpitrain.spatial.mesh import mesh_batch, mesh_model
from tests.helpers import assert_all_ranks, assert_close_all_ranks, bitwise_equal, calls_recorded

EPOCHS = 3


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)).double()


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def batches(seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three global batches of 9, 7 and 5 rows: uneven over 2, 3 and 4 ranks (float64)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
            for n in (9, 7, 5)]


#: name -> (scheduler factory, fit's lr_interval, fit's lr_monitor). The plateau runs in mode "max" on a
#: falling loss, so that it cuts the LR (patience 0: from epoch 2 on) within 3 epochs.
SCHEDULERS: dict[str, tuple[Callable[[Any], Any], str | None, str | None]] = {
    "StepLR": (lambda o: sched.StepLR(o, step_size=1, gamma=0.5), "epoch", None),
    "MultiStepLR": (lambda o: sched.MultiStepLR(o, milestones=[1, 2], gamma=0.3), "epoch", None),
    "CosineAnnealingLR": (lambda o: sched.CosineAnnealingLR(o, T_max=EPOCHS), "epoch", None),
    "ReduceLROnPlateau": (lambda o: sched.ReduceLROnPlateau(o, mode="max", patience=0, factor=0.5), None, None),
    "ReduceLROnPlateau-loss": (lambda o: sched.ReduceLROnPlateau(o, mode="max", patience=0, factor=0.3),
                               "epoch", "loss"),
}


def one_process(model: nn.Module, data, make: Callable[[Any], Any], monitor: str | None, eval_data=None,
                loss_fn: Callable[..., torch.Tensor] = F.cross_entropy, epochs: int = EPOCHS):
    """The torchvision loop in one process: the model, each epoch's LR (its last step's), the scheduler."""
    opt = sgd(model.parameters())
    scheduler = make(opt)
    lrs = []
    for _ in range(epochs):
        total, rows = 0.0, 0
        for x, y in data:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            total, rows = total + loss.item() * len(y), rows + len(y)
        lrs.append(opt.param_groups[0]["lr"])
        if not isinstance(scheduler, sched.ReduceLROnPlateau):
            scheduler.step()
        elif monitor == "loss":
            scheduler.step(total / rows)
        else:  # eval_loss: the mean over every eval target (integer targets: each batch by its rows)
            with torch.no_grad():
                n = sum(len(y) for _, y in eval_data)
                scheduler.step(sum(loss_fn(model(x), y).item() * len(y) for x, y in eval_data) / n)
    return model, lrs, scheduler


def recording(make: Callable[[Any], Any]) -> tuple[Callable[[Any], Any], list[Any]]:
    """`make` and the list of the schedulers it built (the one fit trained with is the last)."""
    made: list[Any] = []

    def factory(opt):
        made.append(make(opt))
        return made[-1]
    return factory, made


def _check_run(comm, result, made, ref, ref_lrs, ref_sched, what: str, atol: float = 1e-10) -> None:
    lrs = [h["lr"] for h in result.history]
    assert_all_ranks(comm, len(lrs) == EPOCHS and all(abs(a - b) <= 1e-15 * abs(b) for a, b in zip(lrs, ref_lrs)),
                     f"{what}: LR history {lrs} != one process's {ref_lrs}")
    assert_all_ranks(comm, result.optimizer.param_groups[0]["lr"] == pytest.approx(ref_sched.optimizer.param_groups[0]
                                                                                   ["lr"], rel=1e-15),
                     f"{what}: LR after the run differs from one process's")
    for (name, p), q in zip(result.model.state_dict().items(), ref.state_dict().values()):
        assert_close_all_ranks(comm, p.double(), q.double(), atol, atol, f"{what}: {name}")
    if isinstance(ref_sched, sched.ReduceLROnPlateau):  # the monitored value is the job's: alike on every rank
        mine = (made[-1].best, made[-1].num_bad_epochs, made[-1].last_epoch)
        every = comm.allgather_object(mine)
        assert_all_ranks(comm, all(v == every[0] for v in every), f"{what}: plateau state per rank {every}")
        assert_all_ranks(comm, mine[1:] == (ref_sched.num_bad_epochs, ref_sched.last_epoch)
                         and abs(mine[0] - ref_sched.best) <= atol, f"{what}: plateau {mine} vs one process "
                         f"{(ref_sched.best, ref_sched.num_bad_epochs, ref_sched.last_epoch)}")
        key = "eval_loss" if "eval_loss" in result.history[0] else "loss"
        values = comm.allgather_object([h[key] for h in result.history])
        assert_all_ranks(comm, all(v == values[0] for v in values), f"{what}: {key} per rank {values}")
    else:
        assert_all_ranks(comm, made[-1].last_epoch == EPOCHS, f"{what}: stepped {made[-1].last_epoch} times, "
                                                              f"not once per epoch")


STRATEGIES: dict[str, dict[str, object]] = {
    "data": {"strategy": "data"},
    "data-zero1": {"strategy": "data", "zero": 1},
    "model": {"strategy": "model", "micro_batches": 2, "balance": "params", "profile_passes": 1},
    "pipe-sgd-K1": {"strategy": "pipe-sgd", "staleness": 1},
    "hybrid": {"strategy": "hybrid", "micro_batches": 2, "balance": "params", "profile_passes": 1},
}


def layout(strategy: str, size: int) -> dict[str, object]:
    """fit's keywords for `strategy` on `size` ranks (hybrid: 2 x size/2, or 1 x size on an odd count)."""
    if strategy != "hybrid":
        return STRATEGIES[strategy]
    partitions, replicas = (2, size // 2) if size % 2 == 0 else (1, size)
    return {**STRATEGIES[strategy], "partitions": partitions, "replicas": replicas}


# -- MPI: every strategy equals the torchvision loop in one process -----------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_epoch_schedule_equals_the_torchvision_loop_in_one_process(comm, strategy, name):
    make, interval, monitor = SCHEDULERS[name]
    plateau_eval = name == "ReduceLROnPlateau"  # its default monitor: eval_loss, with eval_data
    eval_data = batches(seed=7) if plateau_eval else None
    factory, made = recording(make)
    result = fit(mlp(), batches(), F.cross_entropy, sgd, epochs=EPOCHS, lr_scheduler=factory, lr_interval=interval,
                 lr_monitor=monitor, eval_data=eval_data, progress=False, **layout(strategy, comm.size))
    ref, lrs, ref_sched = one_process(mlp(), batches(), make, "eval_loss" if plateau_eval else monitor, eval_data)
    _check_run(comm, result, made, ref, lrs, ref_sched, f"{strategy} {name}")
    assert_all_ranks(comm, len(set(lrs)) > 1, f"{name}: the schedule never changed the LR ({lrs}): no test")


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["MultiStepLR", "ReduceLROnPlateau-loss"])
def test_epoch_schedule_under_spatial_equals_one_process(comm, name):
    make, interval, monitor = SCHEDULERS[name]

    def model() -> nn.Module:
        torch.manual_seed(0)
        return mesh_model(in_channels=3, widths=(4, 6), convs_per_block=1)

    data = [mesh_batch(2, 16, in_channels=3, blocks=2, seed=s) for s in range(2)]
    loss_fn = nn.CrossEntropyLoss()
    factory, made = recording(make)
    result = fit(model(), data, loss_fn, sgd, strategy="spatial", grid=(comm.size, 1), epochs=EPOCHS,
                 lr_scheduler=factory, lr_interval=interval, lr_monitor=monitor, progress=False)
    ref, lrs, ref_sched = one_process(copy.deepcopy(model()), data, make, monitor, loss_fn=loss_fn)
    _check_run(comm, result, made, ref, lrs, ref_sched, f"spatial {name}", atol=1e-5)


# -- MPI: stop mid-epoch and resume: bit-identical, the scheduler's state included -----------------------
@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["data", "model"])
@pytest.mark.parametrize("name", ["StepLR", "ReduceLROnPlateau"])
def test_stopped_mid_epoch_and_resumed_ends_bit_identical(comm, tmp_path, strategy, name):
    root = Path(comm.broadcast_object(str(tmp_path)))
    make, interval, monitor = SCHEDULERS[name]
    eval_data = batches(seed=7) if name == "ReduceLROnPlateau" else None

    def run(folder: str, stop_at: int | None = None, resume: bool = False):
        factory, made = recording(make)
        result = fit(mlp(), batches(), F.cross_entropy, sgd, epochs=EPOCHS, lr_scheduler=factory,
                     lr_interval=interval, lr_monitor=monitor, eval_data=eval_data, checkpoint_dir=root / folder,
                     checkpoint_every=2, resume=resume, progress=False,
                     on_step_end=lambda s: stop_at is not None and s.step == stop_at, **STRATEGIES[strategy])
        return result, made[-1]

    full, full_sched = run("full")
    stopped, stopped_sched = run("part", stop_at=4)  # epoch 2's first step: a partial epoch
    # Lightning's rule: the partial epoch steps the schedule too (not in its checkpoint: the resume redoes it)
    assert_all_ranks(comm, len(stopped.history) == 2 and stopped_sched.last_epoch == 2,
                     f"stopped run: {len(stopped.history)} records, scheduler stepped {stopped_sched.last_epoch}")
    resumed, resumed_sched = run("part", resume=True)

    def strip(history):
        return [{k: v for k, v in h.items() if k != "samples_per_s"} for h in history]
    assert_all_ranks(comm, bitwise_equal(full.model.state_dict(), resumed.model.state_dict()),
                     f"{strategy} {name}: resumed weights differ from the uninterrupted run's")
    assert_all_ranks(comm, strip(full.history) == strip(resumed.history),
                     f"{strategy} {name}: histories {strip(full.history)} vs {strip(resumed.history)}")
    assert_all_ranks(comm, bitwise_equal(full_sched.state_dict(), resumed_sched.state_dict()),
                     f"{strategy} {name}: scheduler {full_sched.state_dict()} vs {resumed_sched.state_dict()}")
    assert_all_ranks(comm, bitwise_equal(full.optimizer.state_dict(), resumed.optimizer.state_dict()),
                     f"{strategy} {name}: optimizer state differs")


# -- bad input: FitError on every rank before any message ---------------------------------------------------
BAD: list[tuple[dict[str, object], str]] = [
    ({"lr_scheduler": SCHEDULERS["StepLR"][0], "lr_interval": "batch"}, "lr_interval must be 'step'"),
    ({"lr_interval": "epoch"}, "which was not given"),
    ({"lr_monitor": "loss"}, "which was not given"),
    ({"lr_scheduler": SCHEDULERS["StepLR"][0], "lr_monitor": 3}, "lr_monitor must be the name"),
    ({"lr_scheduler": SCHEDULERS["StepLR"][0], "lr_monitor": "loss"}, "a StepLR steps without one"),
    ({"lr_scheduler": SCHEDULERS["ReduceLROnPlateau"][0], "lr_interval": "step"}, "exists once per epoch"),
    ({"lr_scheduler": SCHEDULERS["ReduceLROnPlateau"][0], "lr_monitor": "eval_loss"}, "eval_loss needs eval_data"),
    ({"lr_scheduler": SCHEDULERS["ReduceLROnPlateau"][0], "lr_monitor": "val_loss"}, "Lightning's 'val_loss'"),
    ({"lr_scheduler": SCHEDULERS["ReduceLROnPlateau"][0], "lr_monitor": "samples_per_s"}, r"hold \['loss'\]"),
    ({"lr_scheduler": SCHEDULERS["StepLR"][0], "interval": "epoch"}, r"fit's keywords are \['lr_interval'\]"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["data", "model"])
def test_bad_schedule_keywords_are_refused_on_every_rank_before_any_message(comm, strategy):
    sent = []
    for kwargs, match in BAD:
        with calls_recorded() as names, pytest.raises(FitError, match=match):
            fit(mlp(), batches(), F.cross_entropy, sgd, progress=False, **STRATEGIES[strategy], **kwargs)
        sent += [(match, name) for name in names]
    assert_all_ranks(comm, not sent, f"messages before the refusal: {sent[:4]}")


# -- one process ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", BAD)
def test_bad_schedule_keywords_are_refused(kwargs, match):
    with pytest.raises(FitError, match=match):
        fit(mlp(), batches(), F.cross_entropy, sgd, progress=False, **kwargs)


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_epoch_schedule_in_one_process_is_the_torchvision_loop(name):
    make, interval, monitor = SCHEDULERS[name]
    eval_data = batches(seed=7) if name == "ReduceLROnPlateau" else None
    factory, made = recording(make)
    result = fit(mlp(), batches(), F.cross_entropy, sgd, epochs=EPOCHS, lr_scheduler=factory, lr_interval=interval,
                 lr_monitor=monitor, eval_data=eval_data, progress=False)
    ref, lrs, ref_sched = one_process(mlp(), batches(), make, "eval_loss" if eval_data else monitor, eval_data)
    assert [h["lr"] for h in result.history] == pytest.approx(lrs, rel=1e-15) and len(set(lrs)) > 1
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(result.model.parameters(), ref.parameters()))


def test_the_default_interval_still_steps_every_optimizer_step():
    factory, made = recording(SCHEDULERS["StepLR"][0])
    result = fit(mlp(), batches(), F.cross_entropy, sgd, epochs=2, lr_scheduler=factory, progress=False)
    assert made[-1].last_epoch == 2 * len(batches())
    assert [h["lr"] for h in result.history] == pytest.approx([0.2 * 0.5 ** 2, 0.2 * 0.5 ** 5])


def test_an_instance_optimizer_is_probed_without_its_state_and_left_alone():
    model = mlp()
    opt = sgd(model.parameters())
    before = copy.deepcopy(opt.state_dict())
    fit(model, batches(), F.cross_entropy, opt, epochs=1, lr_scheduler=SCHEDULERS["StepLR"][0], lr_interval="epoch",
        progress=False)
    assert opt.state_dict() == before and opt.param_groups[0]["lr"] == 0.2


@pytest.mark.mpi
@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_fp16_skipped_steps_are_not_scheduler_steps_per_step_and_change_nothing_per_epoch(comm, interval):
    """An init scale of 2**24 overflows the first step(s) (skipped on every rank): "step" does not step the
    schedule after them, "epoch" steps it once per epoch all the same."""
    data = [(x.float(), y) for x, y in batches()]
    factory, made = recording(SCHEDULERS["StepLR"][0])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, backoff_factor=2.0 ** -8)
    result = fit(mlp().float(), data, F.cross_entropy, sgd, strategy="data", epochs=EPOCHS, lr_scheduler=factory,
                 lr_interval=interval, precision="fp16", grad_scaler=scaler, progress=False)
    skipped = result.history[-1]["skipped_steps"]
    expected = EPOCHS if interval == "epoch" else EPOCHS * len(data) - skipped
    assert_all_ranks(comm, skipped > 0 and made[-1].last_epoch == expected,
                     f"{interval}: {skipped} skipped, scheduler stepped {made[-1].last_epoch}, expected {expected}")
